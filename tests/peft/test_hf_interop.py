"""Interoperability with the real Hugging Face ``peft`` library on a tiny random Qwen3 (no download).

plait's LoRA/DoRA is applied directly onto the transformers module, so the module names are the
transformers ones; adapters go plait -> peft and peft -> plait, and logits must agree (fp32, 1e-5).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from plait.peft import DoRAConfig, LoRAConfig, LoRALinear, apply_peft, merge_peft  # noqa: E402
from plait.peft.hf import export_hf_adapter, import_hf_adapter  # noqa: E402


def tiny_qwen3(seed: int = 0) -> torch.nn.Module:
    cfg = transformers.Qwen3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=32,
        attn_implementation="eager",
    )
    torch.manual_seed(seed)
    return transformers.Qwen3ForCausalLM(cfg).eval()


IDS = torch.tensor([[1, 5, 9, 3, 7, 2], [4, 4, 8, 0, 6, 1]])


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


ATTN = r"model\.layers\.\d+\.self_attn\.(q|k|v|o)_proj"
MLP = r"model\.layers\.\d+\.mlp\.(gate|up|down)_proj"


@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
def test_plait_adapter_loads_in_peft(tmp_path: Path, dora: bool) -> None:
    model = tiny_qwen3()
    base_logits = logits(model)
    cls = DoRAConfig if dora else LoRAConfig
    # two ranks/alphas -> rank_pattern/alpha_pattern; rsLoRA
    apply_peft(
        model,
        [
            cls(r=4, alpha=8, target_modules=ATTN, init="random", use_rslora=True),
            cls(r=2, alpha=3, target_modules=MLP, init="random", use_rslora=True),
        ],
    )
    if dora:
        with torch.no_grad():  # a trained magnitude differs from the initial row norms
            for m in model.modules():
                if hasattr(m, "lora_magnitude_vector"):
                    m.lora_magnitude_vector.mul_(1.0 + 0.1 * torch.rand_like(m.lora_magnitude_vector))
    ours = logits(model)
    assert not torch.allclose(ours, base_logits, atol=1e-3)
    config = export_hf_adapter(model, tmp_path, task_type="CAUSAL_LM")
    on_disk = json.loads((tmp_path / "adapter_config.json").read_text())
    assert on_disk == config and on_disk["use_dora"] is dora and on_disk["use_rslora"] is True
    # 8 attention modules (r=4) outnumber 6 MLP modules (r=2): r=4 is the default, MLP goes to the patterns
    assert on_disk["r"] == 4 and set(on_disk["rank_pattern"].values()) == {2}, on_disk

    theirs = peft.PeftModel.from_pretrained(tiny_qwen3(), str(tmp_path)).eval()
    torch.testing.assert_close(logits(theirs), ours, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
def test_peft_adapter_imports_into_plait(tmp_path: Path, dora: bool) -> None:
    hf_cfg = peft.LoraConfig(
        r=4,
        lora_alpha=6,
        target_modules=["q_proj", "v_proj", "down_proj"],
        rank_pattern={"down_proj": 2},
        alpha_pattern={"down_proj": 5},
        init_lora_weights=False,  # non-zero B
        use_dora=dora,
    )
    theirs = peft.get_peft_model(tiny_qwen3(), hf_cfg).eval()
    expected = logits(theirs)
    theirs.save_pretrained(str(tmp_path))

    model = tiny_qwen3()
    report = import_hf_adapter(model, tmp_path)
    assert report is not None and len(report.adapted) == 6
    assert all(isinstance(model.get_submodule(a.name), LoRALinear) for a in report.adapted)
    down = model.get_submodule("model.layers.0.mlp.down_proj")
    assert (down.r, down.alpha) == (2, 5.0)
    torch.testing.assert_close(logits(model), expected, atol=1e-5, rtol=1e-5)


def test_import_rejects_unsupported(tmp_path: Path) -> None:
    theirs = peft.get_peft_model(
        tiny_qwen3(), peft.LoraConfig(r=2, target_modules=["q_proj"], lora_bias=True)
    )
    theirs.save_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match="lora_bias"):
        import_hf_adapter(tiny_qwen3(), tmp_path)


def tiny_qwen3_moe(seed: int = 0) -> torch.nn.Module:
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        moe_intermediate_size=8,
        num_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=32,
        attn_implementation="eager",
    )
    torch.manual_seed(seed)
    return transformers.Qwen3MoeForCausalLM(cfg).eval()


EXPERTS = r"model\.layers\.\d+\.mlp\.experts\.(gate_up_proj|down_proj)"


def test_expert_lora_exports_to_peft_target_parameters(tmp_path: Path) -> None:
    # transformers' experts do not call plait's adapter hook, so compare through merge_peft:
    # plait-merged weights vs peft's own forward with the exported adapter.
    model = tiny_qwen3_moe()
    report = apply_peft(
        model,
        LoRAConfig(r=2, alpha=4, target_modules=r".*\.q_proj", target_parameters=EXPERTS, init="random"),
        require_expert_hook=False,
    )
    assert sum(a.method == "lora_experts" for a in report.adapted) == 4
    config = export_hf_adapter(model, tmp_path)
    assert config["target_parameters"] == [
        f"model.layers.{i}.mlp.experts.{p}" for i in range(2) for p in ("gate_up_proj", "down_proj")
    ]
    base_logits = logits(model)
    merge_peft(model)
    ours = logits(model)
    assert not torch.allclose(ours, base_logits, atol=1e-3)
    theirs = peft.PeftModel.from_pretrained(tiny_qwen3_moe(), str(tmp_path)).eval()
    torch.testing.assert_close(logits(theirs), ours, atol=1e-5, rtol=1e-5)


def test_peft_expert_adapter_imports_into_plait(tmp_path: Path) -> None:
    hf_cfg = peft.LoraConfig(
        r=2,
        lora_alpha=3,
        target_modules=["v_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
        init_lora_weights=False,
    )
    theirs = peft.get_peft_model(tiny_qwen3_moe(), hf_cfg).eval()
    expected = logits(theirs)
    theirs.save_pretrained(str(tmp_path))
    model = tiny_qwen3_moe()
    report = import_hf_adapter(model, tmp_path, require_expert_hook=False)
    assert report is not None
    assert {a.name for a in report.adapted if a.method == "lora_experts"} == {
        f"model.layers.{i}.mlp.experts.{p}" for i in range(2) for p in ("gate_up_proj", "down_proj")
    }
    merge_peft(model)
    torch.testing.assert_close(logits(model), expected, atol=1e-5, rtol=1e-5)


def test_plait_qwen3_adapter_round_trip_with_peft(tmp_path: Path) -> None:
    """plait's own Qwen3 (HF module names) + plait LoRA -> HF adapter -> peft on transformers' Qwen3, and back."""
    models = pytest.importorskip("plait.models")
    hf = tiny_qwen3()
    config = models.config_from_hf(hf.config)
    plait_model = models.build_causal_lm(config).eval()
    state = models.hf_to_plait_mapper(config).map_state(hf.state_dict())
    plait_model.load_state_dict(state)

    def plait_logits(m: torch.nn.Module) -> torch.Tensor:
        with torch.no_grad():
            return m(input_ids=IDS, return_logits=True)["logits"]

    torch.testing.assert_close(plait_logits(plait_model), logits(hf), atol=1e-5, rtol=1e-5)
    apply_peft(plait_model, LoRAConfig(r=4, alpha=8, target_modules=ATTN + "|" + MLP, init="random"))
    ours = plait_logits(plait_model)
    export_hf_adapter(plait_model, tmp_path / "out", task_type="CAUSAL_LM")
    theirs = peft.PeftModel.from_pretrained(tiny_qwen3(), str(tmp_path / "out")).eval()
    torch.testing.assert_close(logits(theirs), ours, atol=1e-5, rtol=1e-5)

    back = models.build_causal_lm(config).eval()
    back.load_state_dict(state)
    import_hf_adapter(back, tmp_path / "out")
    torch.testing.assert_close(plait_logits(back), ours, atol=1e-5, rtol=1e-5)


def test_plait_qwen3_moe_expert_adapter_to_peft(tmp_path: Path) -> None:
    """plait's Qwen3-MoE (plait.moe experts, same [E, out, in] names as transformers) + expert LoRA
    -> HF target_parameters adapter -> peft on transformers' Qwen3-MoE: the unmerged forward (the
    experts call the adapter hook inside the grouped computation) and the merged one both match."""
    models = pytest.importorskip("plait.models")
    hf = tiny_qwen3_moe()
    config = models.config_from_hf(hf.config)
    plait_model = models.build_causal_lm(config).eval()
    plait_model.load_state_dict(models.hf_to_plait_mapper(config).map_state(hf.state_dict()))

    def plait_logits(m: torch.nn.Module) -> torch.Tensor:
        with torch.no_grad():
            return m(input_ids=IDS, return_logits=True)["logits"]

    torch.testing.assert_close(plait_logits(plait_model), logits(hf), atol=1e-5, rtol=1e-5)
    apply_peft(
        plait_model,
        LoRAConfig(r=2, alpha=4, target_modules=ATTN, target_parameters=EXPERTS, init="random"),
    )
    export_hf_adapter(plait_model, tmp_path)
    unmerged = plait_logits(plait_model)
    merge_peft(plait_model)
    theirs = peft.PeftModel.from_pretrained(tiny_qwen3_moe(), str(tmp_path)).eval()
    reference = logits(theirs)
    assert not torch.allclose(reference, logits(hf), atol=1e-3), "the adapter must change the logits"
    torch.testing.assert_close(unmerged, reference, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(plait_logits(plait_model), reference, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
def test_training_forward_and_grads_match_peft_with_dropout(tmp_path: Path, dora: bool) -> None:
    """Train-mode numerics (dropout active, DoRA's detached norm) and adapter gradients equal peft's."""
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Tanh(), torch.nn.Linear(6, 5))
    theirs = peft.get_peft_model(
        base,
        peft.LoraConfig(
            r=2,
            lora_alpha=3,
            lora_dropout=0.3,
            target_modules=["0", "2"],
            use_dora=dora,
            init_lora_weights=False,
        ),
    )
    theirs.save_pretrained(str(tmp_path))
    torch.manual_seed(0)
    ours = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Tanh(), torch.nn.Linear(6, 5))
    import_hf_adapter(ours, tmp_path)
    theirs.train()
    ours.train()
    x = torch.randn(7, 8)
    torch.manual_seed(1)
    y_theirs = theirs(x)
    torch.manual_seed(1)  # same dropout masks: both draw one mask per layer on the adapter input
    y_ours = ours(x)
    torch.testing.assert_close(y_ours, y_theirs, atol=1e-6, rtol=1e-5)
    y_theirs.square().sum().backward()
    y_ours.square().sum().backward()
    their_grads = {
        n.removeprefix("base_model.model.")
        .replace(".default", "")
        .replace("_vector.weight", "_vector"): p.grad
        for n, p in theirs.named_parameters()
        if p.requires_grad
    }
    our_grads = {n: p.grad for n, p in ours.named_parameters() if p.requires_grad}
    assert set(our_grads) == set(their_grads) and len(our_grads) == (6 if dora else 4)
    for n, g in our_grads.items():
        torch.testing.assert_close(g, their_grads[n], atol=1e-6, rtol=1e-5, msg=n)


# ------------------------------------------------------------------------------- Llama and gpt-oss
GPT_OSS_EXPERTS = r"model\.layers\.\d+\.mlp\.experts\.(gate_up_proj|down_proj)"


def _family_models(case: str, tmp_path: Path) -> tuple[torch.nn.Module, Path]:
    """plait's model of a tiny transformers checkpoint of ``case`` (tests/models/_families.py) and the
    checkpoint's directory (transformers and peft load their own copy from it)."""
    from plait.models import from_pretrained

    from ..models._families import make_hf

    path, _ = make_hf(case, tmp_path)
    return from_pretrained(path).eval(), path


def _hf_logits(path: Path, adapter: Path | None = None) -> torch.Tensor:
    from ..models._families import CASES

    model = getattr(transformers, CASES["gpt_oss" if "gpt_oss" in path.name else "llama"][1])
    hf = model.from_pretrained(path).eval()
    return logits(hf if adapter is None else peft.PeftModel.from_pretrained(hf, str(adapter)).eval())


def _plait_logits(m: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return m(input_ids=IDS)["logits"]


def _perturb_magnitudes(model: torch.nn.Module) -> None:
    with torch.no_grad():  # a trained magnitude differs from the initial row norms
        for m in model.modules():
            if hasattr(m, "lora_magnitude_vector"):
                m.lora_magnitude_vector.mul_(1.0 + 0.1 * torch.rand_like(m.lora_magnitude_vector))


@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
def test_plait_llama_adapter_loads_in_peft(tmp_path: Path, dora: bool) -> None:
    """plait's Llama (biases, tied embeddings, one KV head) + LoRA/DoRA on every attention and MLP
    linear -> HF PEFT adapter -> peft on transformers' Llama: the same logits; and back into plait."""
    model, path = _family_models("llama_mqa_tied_bias", tmp_path)
    base = _plait_logits(model)
    cls = DoRAConfig if dora else LoRAConfig
    apply_peft(
        model,
        [
            cls(r=4, alpha=8, target_modules=ATTN, init="random"),
            cls(r=2, alpha=3, target_modules=MLP, init="random"),
        ],
    )
    if dora:
        _perturb_magnitudes(model)
    ours = _plait_logits(model)
    assert not torch.allclose(ours, base, atol=1e-3), "the adapter must change the logits"
    config = export_hf_adapter(model, tmp_path / "adapter", task_type="CAUSAL_LM")
    assert config["use_dora"] is dora and config["r"] == 4 and set(config["rank_pattern"].values()) == {2}
    torch.testing.assert_close(_hf_logits(path, tmp_path / "adapter"), ours, atol=1e-5, rtol=1e-5)

    back, _ = _family_models("llama_mqa_tied_bias", tmp_path / "back")
    report = import_hf_adapter(back, tmp_path / "adapter")
    assert report is not None and len(report.adapted) == 3 * 7
    torch.testing.assert_close(_plait_logits(back), ours, atol=1e-5, rtol=1e-5)


def test_plait_gpt_oss_expert_adapter_loads_in_peft(tmp_path: Path) -> None:
    """plait's gpt-oss + LoRA on the attention linears and on the experts (plait's output-major,
    gate-first layout; exported in transformers' input-major, gate/up-interleaved order through
    ``expert_out_order``) -> HF ``target_parameters`` adapter -> peft on transformers' gpt-oss: the
    unmerged forward (the experts call the adapter inside the grouped computation) and the merged
    one give peft's logits; and the adapter imports back into plait."""
    from plait.moe import interleaved_order

    model, path = _family_models("gpt_oss", tmp_path)
    intermediate = model.config.intermediate_size

    def order(name: str) -> torch.Tensor | None:
        return interleaved_order(intermediate) if name.endswith("gate_up_proj") else None

    base = _plait_logits(model)
    report = apply_peft(
        model, LoRAConfig(r=2, alpha=4, target_modules=ATTN, target_parameters=GPT_OSS_EXPERTS, init="random")
    )
    assert sum(a.method == "lora_experts" for a in report.adapted) == 2 * 3
    unmerged = _plait_logits(model)
    assert not torch.allclose(unmerged, base, atol=1e-3), "the adapter must change the logits"
    config = export_hf_adapter(model, tmp_path / "adapter", task_type="CAUSAL_LM", expert_out_order=order)
    assert config["target_parameters"] == [
        f"model.layers.{i}.mlp.experts.{p}" for i in range(3) for p in ("gate_up_proj", "down_proj")
    ]
    reference = _hf_logits(path, tmp_path / "adapter")
    torch.testing.assert_close(unmerged, reference, atol=1e-5, rtol=1e-5)

    back, _ = _family_models("gpt_oss", tmp_path / "back")
    import_hf_adapter(back, tmp_path / "adapter", expert_out_order=order)
    torch.testing.assert_close(_plait_logits(back), reference, atol=1e-5, rtol=1e-5)
    merge_peft(model)
    torch.testing.assert_close(_plait_logits(model), reference, atol=1e-5, rtol=1e-5)

    # Without the order the gate/up rows land on the wrong transformers columns.
    model, _ = _family_models("gpt_oss", tmp_path / "unordered")
    apply_peft(model, LoRAConfig(r=2, alpha=4, target_parameters=GPT_OSS_EXPERTS, init="random"))
    export_hf_adapter(model, tmp_path / "unordered_adapter")
    assert not torch.allclose(
        _hf_logits(path, tmp_path / "unordered_adapter"), _plait_logits(model), atol=1e-3
    )


def test_plait_gpt_oss_dora_attention_adapter_loads_in_peft(tmp_path: Path) -> None:
    """DoRA on gpt-oss's attention linears (biased q/k/v/o, next to sinks): peft's logits. DoRA on
    the experts exists on neither side: peft refuses ``use_dora`` with ``target_parameters`` and
    plait's DoRAConfig has no ``target_parameters``."""
    model, path = _family_models("gpt_oss", tmp_path)
    apply_peft(model, DoRAConfig(r=4, alpha=8, target_modules=ATTN, init="random"))
    _perturb_magnitudes(model)
    ours = _plait_logits(model)
    export_hf_adapter(model, tmp_path / "adapter", task_type="CAUSAL_LM")
    torch.testing.assert_close(_hf_logits(path, tmp_path / "adapter"), ours, atol=1e-5, rtol=1e-5)

    hf_model = transformers.GptOssForCausalLM.from_pretrained(path)
    with pytest.raises(ValueError, match="ParamWrapper does not work with use_dora"):
        peft.get_peft_model(
            hf_model, peft.LoraConfig(r=2, target_parameters=["mlp.experts.gate_up_proj"], use_dora=True)
        )
    with pytest.raises(ValueError, match="target_parameters"):
        DoRAConfig(r=2, alpha=4, target_parameters=GPT_OSS_EXPERTS)  # type: ignore[call-arg]
