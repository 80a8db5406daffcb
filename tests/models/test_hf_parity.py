"""plait Qwen3 / Qwen3-MoE against real transformers: logits, export round trip, checkpoint diff."""

from __future__ import annotations

import pytest
import torch
import transformers
from plait.models import (
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    from_pretrained,
    load_hf_config,
    save_hf_checkpoint,
)
from safetensors import safe_open

from ._hf_utils import make_hf

CASES = {
    "dense": ("dense", {}),
    "dense_tied": ("dense", {"tie_word_embeddings": True}),
    "dense_bias_yarn": (
        "dense",
        {
            "attention_bias": True,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 5000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
    ),
    "moe_norm_topk": ("moe", {"norm_topk_prob": True}),
    "moe_no_norm_mixed": ("moe", {"norm_topk_prob": False, "mlp_only_layers": [1]}),
    "moe_sparse_step_tied": (
        "moe",
        {"decoder_sparse_step": 2, "tie_word_embeddings": True, "norm_topk_prob": True},
    ),
}


def _ids(vocab: int = 128, b: int = 2, s: int = 12) -> torch.Tensor:
    return torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("case", sorted(CASES))
def test_parity_and_round_trip(case, tmp_path):
    """Logits and loss equal transformers'; config maps field by field; the export reloads in
    transformers with identical logits and byte-identical tensors under the original keys."""
    kind, overrides = CASES[case]
    path, hf = make_hf(kind, tmp_path, **overrides)
    model = from_pretrained(path)
    ids = _ids()
    with torch.no_grad():
        ref = hf(ids).logits
        out = model(input_ids=ids)["logits"]
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)

    labels = torch.roll(ids, -1, dims=1)
    labels[:, -1] = -100
    with torch.no_grad():
        res = model(input_ids=ids, labels=labels)
    ref_loss = torch.nn.functional.cross_entropy(ref.flatten(0, 1), labels.flatten(), ignore_index=-100)
    torch.testing.assert_close(res["loss"], ref_loss, atol=1e-5, rtol=1e-5)
    assert int(res["num_tokens"]) == 2 * 11

    cfg = load_hf_config(path)
    assert cfg.model_type == hf.config.model_type
    assert cfg.tie_word_embeddings == hf.config.tie_word_embeddings
    if isinstance(cfg, Qwen3MoeConfig):
        assert cfg.num_experts == hf.config.num_experts
        for i in range(cfg.num_hidden_layers):
            hf_sparse = type(hf.model.layers[i].mlp).__name__.endswith("SparseMoeBlock")
            assert cfg.is_moe_layer(i) == hf_sparse, i

    exported = save_hf_checkpoint(model, tmp_path / "export")
    reloaded = type(hf).from_pretrained(exported).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, ref, atol=0, rtol=0)
    with (
        safe_open(str(path / "model.safetensors"), "pt") as a,
        safe_open(str(exported / "model.safetensors"), "pt") as b,
    ):
        assert set(a.keys()) == set(b.keys())
        for k in a.keys():  # noqa: SIM118 (safe_open has no __iter__)
            assert torch.equal(a.get_tensor(k), b.get_tensor(k)), k


def test_model_state_diff_empty(tmp_path, capsys):
    """``python -m plait.model_state diff`` (its ``main``, run in-process) finds no difference."""
    from plait.model_state.cli import main

    path, _ = make_hf("moe", tmp_path, norm_topk_prob=True, mlp_only_layers=[0])
    model = from_pretrained(path)
    out = save_hf_checkpoint(model, tmp_path / "export")
    assert main(["diff", str(path), str(out)]) == 0
    assert capsys.readouterr().out.strip().endswith("SAME")
    # ...and the check can fail: a perturbed expert shows up.
    with torch.no_grad():
        model.model.layers["1"].mlp.experts.down_proj[2, 0, 0] += 1.0
    bad = save_hf_checkpoint(model, tmp_path / "bad")
    assert main(["diff", str(path), str(bad)]) == 1
    assert "model.layers.1.mlp.experts.2.down_proj.weight" in capsys.readouterr().out


def test_fused_expert_layout_loads(tmp_path):
    """transformers 5.x's in-memory fused expert tensors (gate_up_proj / down_proj) load too."""
    path, hf = make_hf("moe", tmp_path, norm_topk_prob=True)
    model = from_pretrained(path)
    fused = save_hf_checkpoint(model, tmp_path / "fused", fused_experts=True)
    with safe_open(str(fused / "model.safetensors"), "pt") as f:
        assert "model.layers.0.mlp.experts.gate_up_proj" in set(f.keys())
    again = from_pretrained(fused)
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=ids)["logits"], hf(ids).logits, atol=1e-5, rtol=0)


def test_meta_build_and_reset_parameters():
    from ._hf_utils import MOE

    cfg = Qwen3MoeConfig(**{**MOE, "tie_word_embeddings": True})
    with torch.device("meta"):
        model = Qwen3ForCausalLM(cfg)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.reset_parameters()
    for name, p in model.named_parameters():
        assert torch.isfinite(p).all(), name
        if name.endswith("norm.weight"):
            assert torch.equal(p, torch.ones_like(p)), name
        else:
            assert 0.01 < p.std().item() < 0.03, name  # normal(0, initializer_range=0.02)
    assert model.lm_head is not None and model.lm_head.weight is model.model.embed_tokens.weight


def test_sequence_classification_matches_transformers():
    """Last non-padding token pooling (found from pad_token_id like HF) + score head."""
    from plait.models import Qwen3ForSequenceClassification, config_from_hf

    from ._hf_utils import BASE

    torch.manual_seed(0)
    hf_cfg = transformers.Qwen3Config(**BASE, num_labels=3, pad_token_id=0)
    hf = transformers.Qwen3ForSequenceClassification(hf_cfg).eval()
    model = Qwen3ForSequenceClassification(config_from_hf(hf_cfg.to_dict()), num_labels=3)
    model.load_state_dict(hf.state_dict())
    ids = _ids().clamp(min=1)
    ids[0, 9:] = 0  # right padding in row 0
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids)["logits"], hf(ids).logits, atol=1e-5, rtol=0)
