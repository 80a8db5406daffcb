"""DeepSeek-V3 beyond the shared family checks: the correction bias and the groups change the
routing as in transformers, block-scaled FP8 checkpoints dequantize while streaming, the
multi-token-prediction weights are skipped, the FLOP count, and bad configs name the key."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest
import torch
from plait.model_state import TensorSpec
from plait.model_state.errors import MapperError
from plait.models import config_from_hf, flops_per_token, from_pretrained, load_hf_config
from plait.models.deepseek_v3 import (
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    Fp8BlockDequantize,
    MultiHeadLatentAttention,
)
from safetensors.torch import load_file, save_file

from ._families import make_hf

BLOCK = (4, 8)  # small blocks: every weight spans several, most with a ragged last block


def _ids() -> torch.Tensor:
    return torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(1))


def _quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's block FP8: one fp32 scale (``amax / 448``) per block, ``w / scale`` in e4m3."""
    br, bc = BLOCK
    rows, cols = w.shape
    nr, nc = -(-rows // br), -(-cols // bc)
    scale = torch.empty(nr, nc)
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(nr):
        for j in range(nc):
            blk = w[i * br : (i + 1) * br, j * bc : (j + 1) * bc]
            s = blk.abs().max().clamp_min(1e-12) / 448.0
            scale[i, j] = s
            q[i * br : (i + 1) * br, j * bc : (j + 1) * bc] = (blk / s).to(torch.float8_e4m3fn)
    return q, scale


def _dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The reference: every element times its block's scale (loops, no index tricks)."""
    out = q.to(torch.float32)
    br, bc = BLOCK
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            out[i * br : (i + 1) * br, j * bc : (j + 1) * bc] *= scale[i, j]
    return out


def _quantized(name: str) -> bool:
    """The weights DeepSeek quantizes: every linear of the decoder layers but the router."""
    return (name.startswith("model.layers.") and name.endswith("proj.weight")) or "proj_with_mqa" in name


def write_fp8(src: Path, dst: Path) -> dict[str, torch.Tensor]:
    """Rewrite the checkpoint at ``src`` as a block-scaled FP8 checkpoint at ``dst``; returns the
    dequantized state (the reference)."""
    dst.mkdir()
    sd = load_file(src / "model.safetensors")
    out, ref = {}, {}
    for k, v in sd.items():
        if _quantized(k):
            q, s = _quantize(v)
            out[k], out[k + "_scale_inv"] = q, s
            ref[k] = _dequantize(q, s)
        else:
            out[k] = ref[k] = v
    save_file(out, dst / "model.safetensors")
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": list(BLOCK),
    }
    (dst / "config.json").write_text(json.dumps(cfg))
    return ref


def test_correction_bias_and_groups_change_the_routing(tmp_path):
    path, hf = make_hf("deepseek_v3", tmp_path)
    ids = _ids()
    with torch.no_grad():
        ref = hf(ids).logits
        model = from_pretrained(path)
        torch.testing.assert_close(
            model(input_ids=ids, return_logits=True)["logits"], ref, atol=1e-5, rtol=1e-5
        )
        # Without the bias the same weights pick other experts (the bias is selection-only, so any
        # change of the logits is a change of the picks); transformers agrees.
        for moe in model.moe_layers():
            moe.router.expert_bias.zero_()
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.zero_()
        unbiased = model(input_ids=ids, return_logits=True)["logits"]
        assert (unbiased - ref).abs().max() > 1e-3
        torch.testing.assert_close(unbiased, hf(ids).logits, atol=1e-5, rtol=1e-5)
        # Keeping every group (topk_group = n_group) changes the picks too: the groups restrict them.
        all_groups = from_pretrained(path, topk_group=4)
        assert (all_groups(input_ids=ids, return_logits=True)["logits"] - ref).abs().max() > 1e-3
    # The load counters of a loaded model start at zero: one training forward counts each token's
    # top-k picks once.
    trained = from_pretrained(path, bias_update_rate=1e-3).train()
    trained(input_ids=ids)
    for moe in trained.moe_layers():
        assert int(moe.update_expert_bias().sum()) == ids.numel() * 3


def test_fp8_checkpoint_dequantizes_block_by_block(tmp_path):
    path, _ = make_hf("deepseek_v3", tmp_path)
    ref_state = write_fp8(path, tmp_path / "fp8")
    assert load_hf_config(tmp_path / "fp8").fp8_block_size == BLOCK
    model = from_pretrained(tmp_path / "fp8")
    plain = from_pretrained(path)
    # The reference model: the plain checkpoint's model with the dequantized weights.
    ref_model = from_pretrained(path)
    from plait.models import hf_to_plait_mapper

    ref_model.load_state_dict(hf_to_plait_mapper(ref_model.config).map_state(ref_state), strict=True)
    for k, v in ref_model.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k
    ids = _ids()
    with torch.no_grad():
        got = model(input_ids=ids, return_logits=True)["logits"]
        torch.testing.assert_close(
            got, ref_model(input_ids=ids, return_logits=True)["logits"], atol=0, rtol=0
        )
        # FP8 rounding moved the weights, so the model is not the bf16/fp32 one
        assert (got - plain(input_ids=ids, return_logits=True)["logits"]).abs().max() > 1e-4


def test_fp8_dequantize_reads_only_the_blocks_of_a_region():
    w = torch.randn(13, 21)
    q, s = _quantize(w)
    full = _dequantize(q, s)
    group = Fp8BlockDequantize(BLOCK).groups(
        {"a.weight": TensorSpec.of(q), "a.weight_scale_inv": TensorSpec.of(s)}
    )[0]
    assert group.outputs["a.weight"] == TensorSpec((13, 21), torch.float32)
    for region in (((5, 11), (0, 21)), ((0, 13), (9, 17)), ((3, 4), (7, 8)), ((12, 13), (20, 21))):
        (r0, r1), (c0, c1) = region
        reads, fn = group.sliced({"a.weight": region})
        assert reads["a.weight"] == region
        (s0, s1), (t0, t1) = reads["a.weight_scale_inv"]
        assert (s0, s1, t0, t1) == (r0 // 4, -(-r1 // 4), c0 // 8, -(-c1 // 8))
        out = fn({"a.weight": q[r0:r1, c0:c1], "a.weight_scale_inv": s[s0:s1, t0:t1]})["a.weight"]
        assert torch.equal(out, full[r0:r1, c0:c1])


def test_fp8_errors_name_the_tensor_or_key(tmp_path):
    path, _ = make_hf("deepseek_v3", tmp_path)
    write_fp8(path, tmp_path / "fp8")
    sd = load_file(tmp_path / "fp8" / "model.safetensors")
    del sd["model.layers.1.self_attn.kv_b_proj.weight_scale_inv"]
    save_file(sd, tmp_path / "fp8" / "model.safetensors")
    with pytest.raises(MapperError, match=r"'model\.layers\.1\.self_attn\.kv_b_proj\.weight' has no scale tensor "
                       r"'model\.layers\.1\.self_attn\.kv_b_proj\.weight_scale_inv'"):  # fmt: skip
        from_pretrained(tmp_path / "fp8")
    # FP8 tensors without a quantization_config
    cfg = json.loads((path / "config.json").read_text())
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(MapperError, match="the model config has no fp8_block_size"):
        from_pretrained(tmp_path / "fp8")
    base = {"model_type": "deepseek_v3", "n_routed_experts": 8, "n_group": 4}
    for quant, key in (
        ({"quant_method": "mxfp4"}, "quant_method='mxfp4'"),
        ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "fmt='e5m2'"),
        ({"quant_method": "fp8", "fmt": "e4m3"}, "weight_block_size=None"),
    ):
        with pytest.raises(ValueError, match=f"quantization_config.{key}"):
            config_from_hf({**base, "quantization_config": quant})


def test_mtp_weights_are_skipped_with_a_note(tmp_path, caplog):
    path, hf = make_hf("deepseek_v3", tmp_path)
    sd = load_file(path / "model.safetensors")
    n = hf.config.num_hidden_layers
    g = torch.Generator().manual_seed(5)
    mtp = {  # DeepSeek-V3's MTP module: a full decoder layer plus its projections, stored as layer n
        f"model.layers.{n}.{k}": torch.randn(*shape, generator=g)
        for k, shape in {
            "enorm.weight": (36,),
            "hnorm.weight": (36,),
            "eh_proj.weight": (36, 72),
            "shared_head.norm.weight": (36,),
            "shared_head.head.weight": (97, 36),
            "embed_tokens.weight": (97, 36),
            "input_layernorm.weight": (36,),
            "self_attn.kv_b_proj.weight": (66, 10),
            "mlp.experts.0.up_proj.weight": (12, 36),
        }.items()
    }
    save_file({**sd, **mtp}, path / "model.safetensors")
    with caplog.at_level(logging.WARNING, logger="plait.models.deepseek_v3.hf"):
        model = from_pretrained(path)
    assert f"skipping {len(mtp)} checkpoint tensors of layers >= {n}" in caplog.text
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids, return_logits=True)["logits"], hf(ids).logits,
                                   atol=1e-5, rtol=1e-5)  # fmt: skip


def test_flops_per_token_counts_mla_and_active_experts():
    cfg = DeepseekV3Config(
        vocab_size=97, hidden_size=36, intermediate_size=50, num_hidden_layers=3, num_attention_heads=6,
        moe_intermediate_size=12, n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2,
        n_shared_experts=2, first_k_dense_replace=1, kv_lora_rank=10, q_lora_rank=14, qk_nope_head_dim=6,
        qk_rope_head_dim=4, v_head_dim=5,
    )  # fmt: skip
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(cfg)
    # Independent count from the built modules: every 2-D weight a token multiplies with, the
    # routed experts at top_k / E of their size.
    active = 0
    for name, p in model.named_parameters():
        if name.endswith("embed_tokens.weight") or p.dim() < 2:
            continue
        frac = 3 / 8 if ".experts." in name else 1.0
        active += int(p.numel() * frac)
    seq = 64
    attention = 6 * seq * 6 * (10 + 5) * 3  # 6 x context x heads x (qk + v) x layers
    assert flops_per_token(cfg, seq) == pytest.approx(6 * active + attention)
    # A trained MTP module: its eh_proj, MoE decoder layer and the (shared) head, counted the same way.
    mtp_cfg = cfg.model_copy(update={"mtp_loss_weight": 0.3})
    with torch.device("meta"):
        mtp_model = DeepseekV3ForCausalLM(mtp_cfg)
    assert mtp_model.mtp is not None
    extra = 97 * 36  # the head, once more
    for n, p in mtp_model.mtp.named_parameters():
        extra += int(p.numel() * (3 / 8 if ".experts." in n else 1.0)) if p.dim() >= 2 else 0
    assert flops_per_token(mtp_cfg, seq) == pytest.approx(6 * (active + extra) + attention * 4 / 3)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"qk_rope_head_dim": 5}, "qk_rope_head_dim=5 must be even"),
        ({"topk_method": "greedy"}, "topk_method='greedy' is not supported"),
        ({"scoring_func": "softmax"}, "scoring_func='softmax' is not supported"),
        ({"n_routed_experts": 10}, r"n_routed_experts \(10\) must be divisible by n_group \(4\)"),
        ({"topk_group": 5}, r"topk_group \(5\) must be <= n_group \(4\)"),
        ({"num_experts_per_tok": 5}, r"num_experts_per_tok \(5\) > the experts of topk_group"),
        ({"first_k_dense_replace": 4}, r"first_k_dense_replace \(4\) > num_hidden_layers"),
        ({"moe_layer_freq": 2}, "moe_layer_freq=2 is not supported"),
        ({"num_foo_heads": 2}, "num_foo_heads"),
    ],
)
def test_bad_config_names_the_key(changes, message):
    base = {"model_type": "deepseek_v3", "n_routed_experts": 8, "n_group": 4, "topk_group": 2,
            "num_experts_per_tok": 2, "num_hidden_layers": 3}  # fmt: skip
    with pytest.raises(ValueError, match=message):
        config_from_hf({**base, **changes})
    with pytest.raises(ValueError, match="num_key_value_heads=2"):
        DeepseekV3Config(num_attention_heads=4, num_key_value_heads=2)


def test_context_gather_accepts_latent_or_expanded():
    cfg = DeepseekV3Config(hidden_size=32, num_attention_heads=4, kv_lora_rank=8, q_lora_rank=None,
                           qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4)  # fmt: skip
    attn = MultiHeadLatentAttention(cfg)
    assert attn.context_gather == "latent"
    attn.context_gather = "expanded"
    assert attn.context_gather == "expanded"
    with pytest.raises(ValueError, match="context_gather must be 'latent' or 'expanded', got 'kv'"):
        attn.context_gather = "kv"


@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
def test_lora_on_mla_exports_a_peft_adapter(tmp_path, dora):
    """LoRA / DoRA on every MLA projection (HF's module names) -> the HF PEFT adapter -> ``peft`` on
    transformers' DeepSeek-V3 gives plait's logits. (The dense MLP is left out: peft's transformers-5
    MoE conversion rewrites ``gate_proj`` / ``up_proj`` targets of a deepseek_v3 model into the
    experts' fused ``gate_up_proj``, so such an adapter would not load in peft as written.)"""
    peft = pytest.importorskip("peft")
    from plait.peft import DoRAConfig, LoRAConfig, apply_peft
    from plait.peft.hf import export_hf_adapter

    path, hf = make_hf("deepseek_v3", tmp_path)
    model = from_pretrained(path).eval()
    cls = DoRAConfig if dora else LoRAConfig
    targets = r"model\.layers\.\d+\.self_attn\.(q_a|q_b|kv_a|kv_b|o)_proj(_with_mqa)?"
    apply_peft(model, cls(r=2, alpha=4, target_modules=targets, init="random"))
    ids = _ids()
    with torch.no_grad():
        ours = model(input_ids=ids, return_logits=True)["logits"]
        assert (ours - hf(ids).logits).abs().max() > 1e-3  # the adapter changes the model
        export_hf_adapter(model, tmp_path / "adapter", task_type="CAUSAL_LM")
        cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
        assert "kv_a_proj_with_mqa" in str(cfg["target_modules"]) and "q_b_proj" in str(cfg["target_modules"])
        theirs = peft.PeftModel.from_pretrained(hf, str(tmp_path / "adapter")).eval()
        torch.testing.assert_close(theirs(ids).logits, ours, atol=1e-5, rtol=1e-5)


def test_pipeline_stages_chain_to_the_whole_model(tmp_path):
    """Two pipeline stages run one after the other (stage IO dicts) give the whole model's loss, its
    gradients and, stage by stage, the same expert-bias updates (each router lives on one stage)."""
    path, _ = make_hf("deepseek_v3", tmp_path)
    cfg = load_hf_config(path).model_copy(update={"bias_update_rate": 0.01, "seq_aux_loss_coef": 0.01})
    torch.manual_seed(0)
    whole = DeepseekV3ForCausalLM(cfg).train()
    whole.reset_parameters()
    stages = [DeepseekV3ForCausalLM(cfg, stage_index=i, num_stages=2).train() for i in range(2)]
    state = whole.state_dict()
    for stage in stages:
        stage.load_state_dict({k: v for k, v in state.items() if k in stage.state_dict()}, strict=True)
    assert [s.layer_ids for s in stages] == [[0, 1], [2]]
    ids = _ids()
    labels = torch.roll(ids, -1, dims=1)
    ref = whole(input_ids=ids, labels=labels)
    (ref["loss"] + ref["aux_loss"]).backward()
    mid = stages[0](input_ids=ids)
    out = stages[1](**mid, labels=labels)
    (out["loss"] + out["aux_loss"]).backward()
    torch.testing.assert_close(out["loss"], ref["loss"], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out["aux_loss"], ref["aux_loss"], atol=1e-6, rtol=1e-6)
    assert float(ref["aux_loss"]) > 0
    grads = {n: p.grad for s in stages for n, p in s.named_parameters()}
    for n, p in whole.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, atol=1e-6, rtol=1e-5, msg=n)
    from plait.moe import update_expert_biases

    update_expert_biases(whole)
    for s in stages:
        update_expert_biases(s)
    staged = [m.router.expert_bias for s in stages for m in s.moe_layers()]
    assert all(torch.equal(a, m.router.expert_bias) for a, m in zip(staged, whole.moe_layers(), strict=True))


# DeepSeek-V3's released config.json (deepseek-ai/DeepSeek-V3), inlined.
RELEASED = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "auto_map": {
        "AutoConfig": "configuration_deepseek.DeepseekV3Config",
        "AutoModel": "modeling_deepseek.DeepseekV3Model",
        "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM",
    },
    "aux_loss_alpha": 0.001,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "ep_size": 1,
    "first_k_dense_replace": 3,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "initializer_range": 0.02,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 8,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    },
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "transformers_version": "4.33.1",
    "use_cache": True,
    "v_head_dim": 128,
    "vocab_size": 129280,
}


def test_released_config_parses_and_counts_37b_active_params():
    from plait.models.common.flops import mlp_params
    from plait.models.deepseek_v3 import mla_softmax_scale
    from plait.models.deepseek_v3.flops import mla_params

    cfg = config_from_hf(dict(RELEASED))
    assert isinstance(cfg, DeepseekV3Config) and cfg.fp8_block_size == (128, 128)
    assert cfg.rope_parameters.rope_type == "yarn" and cfg.rope_parameters.factor == 40
    # DeepSeek's YaRN softmax scale: 192 ** -0.5 * (0.1 * ln 40 + 1) ** 2
    scale = mla_softmax_scale(cfg.qk_head_dim, cfg.rope_parameters, cfg.max_position_embeddings)
    assert scale == pytest.approx(192**-0.5 * (0.1 * math.log(40) + 1) ** 2)
    active = sum(mla_params(cfg) + mlp_params(cfg, i, 2048 * cfg.is_moe_layer(i)) for i in range(61))
    active += 2 * cfg.vocab_size * cfg.hidden_size  # embedding + head
    assert active / 1e9 == pytest.approx(37.55, abs=0.01)  # the paper's "37B activated parameters"


def _with_mtp(path: Path, hf) -> dict[str, torch.nn.Module]:
    """Add a random MTP module to the checkpoint at ``path``, laid out as DeepSeek's (layer index
    ``num_hidden_layers``, per-expert keys, copies of the embedding and the head); returns the
    transformers modules that compute it (the reference)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm

    cfg, n, h = hf.config, hf.config.num_hidden_layers, hf.config.hidden_size
    torch.manual_seed(7)
    mods = {
        "block": DeepseekV3DecoderLayer(cfg, n),
        "enorm": DeepseekV3RMSNorm(h, cfg.rms_norm_eps),
        "hnorm": DeepseekV3RMSNorm(h, cfg.rms_norm_eps),
        "eh_proj": torch.nn.Linear(2 * h, h, bias=False),
        "shared_head.norm": DeepseekV3RMSNorm(h, cfg.rms_norm_eps),
    }
    sd = load_file(path / "model.safetensors")
    with torch.no_grad():
        mods["block"].mlp.gate.e_score_correction_bias.copy_(0.3 * torch.randn(cfg.n_routed_experts))
        for name, mod in mods.items():
            for pn, p in mod.named_parameters():
                p.copy_(
                    1.0 + 0.1 * torch.randn_like(p)
                    if "norm" in name or "norm" in pn
                    else 0.2 * torch.randn_like(p)
                )
            for pn, t in mod.state_dict().items():
                key = f"model.layers.{n}.{pn}" if name == "block" else f"model.layers.{n}.{name}.{pn}"
                if pn == "mlp.experts.gate_up_proj":
                    i = t.shape[1] // 2
                    for e in range(t.shape[0]):
                        sd[f"model.layers.{n}.mlp.experts.{e}.gate_proj.weight"] = t[e, :i].clone()
                        sd[f"model.layers.{n}.mlp.experts.{e}.up_proj.weight"] = t[e, i:].clone()
                elif pn == "mlp.experts.down_proj":
                    for e in range(t.shape[0]):
                        sd[f"model.layers.{n}.mlp.experts.{e}.down_proj.weight"] = t[e].clone()
                else:
                    sd[key] = t.clone()
    sd[f"model.layers.{n}.embed_tokens.weight"] = sd["model.embed_tokens.weight"].clone()
    sd[f"model.layers.{n}.shared_head.head.weight"] = sd["lm_head.weight"].clone()
    save_file(sd, path / "model.safetensors")
    return mods


def test_mtp_module_trains_with_its_loss_weight_and_round_trips(tmp_path, capsys):
    """With ``mtp_loss_weight`` the MTP module is imported and trained: its weighted cross-entropy
    (``t[i + 2]`` from ``h[i]`` and ``embed(t[i + 1])``) equals a reference written with
    transformers' modules, every gradient (trunk, embedding, head, MTP) matches, and the export
    writes the module back byte for byte (with the embedding and head copies)."""
    from plait.model_state.cli import main as model_state_cli
    from plait.models import plait_to_hf_mapper, save_hf_checkpoint

    path, hf = make_hf("deepseek_v3", tmp_path)
    ref_mods = _with_mtp(path, hf)
    n, weight = hf.config.num_hidden_layers, 0.3
    model = from_pretrained(path, mtp_loss_weight=weight)
    assert model.mtp is not None and list(model.mtp) == [str(n)]
    ids = _ids()
    labels = torch.roll(ids, -1, dims=1)
    labels[:, -1] = -100
    labels[0, 4] = -100
    out = model(input_ids=ids, labels=labels)
    (out["loss"] + out["aux_loss"]).backward()

    # The reference: transformers' trunk, then the MTP formula with transformers' modules.
    h_main = hf.model(ids).last_hidden_state
    logits = hf.lm_head(h_main)
    main = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    emb = hf.model.embed_tokens(torch.cat((ids[:, 1:], torch.zeros_like(ids[:, :1])), dim=1))
    x = ref_mods["eh_proj"](torch.cat((ref_mods["enorm"](emb), ref_mods["hnorm"](h_main)), dim=-1))
    pos = torch.arange(ids.shape[1]).unsqueeze(0)
    causal = torch.full((ids.shape[1], ids.shape[1]), float("-inf")).triu(1)[None, None]
    x = ref_mods["block"](
        x, attention_mask=causal, position_embeddings=hf.model.rotary_emb(x, pos), position_ids=pos
    )
    mtp_logits = hf.lm_head(ref_mods["shared_head.norm"](x))
    target = torch.cat((labels[:, 1:], torch.full_like(labels[:, :1], -100)), dim=1)
    mtp = weight * torch.nn.functional.cross_entropy(
        mtp_logits.flatten(0, 1), target.flatten(), ignore_index=-100
    )
    (main + mtp).backward()
    torch.testing.assert_close(out["loss"], main, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out["mtp_loss"], mtp.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out["aux_loss"], mtp, atol=1e-5, rtol=1e-5)

    grads = {k: p.grad for k, p in model.named_parameters() if p.grad is not None}
    ours = plait_to_hf_mapper(model.config, fused_experts=True).map_state(grads)
    want = {k: p.grad for k, p in hf.named_parameters() if p.grad is not None}
    for name, mod in ref_mods.items():
        for pn, p in mod.named_parameters():
            key = f"model.layers.{n}.{pn}" if name == "block" else f"model.layers.{n}.{name}.{pn}"
            want[key] = p.grad
    assert set(ours) >= set(want)
    for k, g in want.items():
        torch.testing.assert_close(ours[k], g, atol=1e-5, rtol=1e-4, msg=k)

    exported = save_hf_checkpoint(model, tmp_path / "export")
    assert model_state_cli(["diff", str(path), str(exported)]) == 0
    assert capsys.readouterr().out.strip().endswith("SAME")
    with pytest.raises(ValueError, match="needs the embedding and the head on one stage"):
        DeepseekV3ForCausalLM(model.config, stage_index=0, num_stages=2)


def test_mtp_targets_stay_inside_packed_documents(tmp_path):
    """A row packing two documents gives the MTP loss of the two documents run on their own (no
    target and no attention crosses the boundary)."""
    path, hf = make_hf("deepseek_v3", tmp_path)
    _with_mtp(path, hf)
    model = from_pretrained(path, mtp_loss_weight=1.0)
    g = torch.Generator().manual_seed(4)
    docs = [torch.randint(0, 97, (1, n), generator=g) for n in (7, 9)]

    def labels_of(ids: torch.Tensor) -> torch.Tensor:
        out = torch.roll(ids, -1, dims=1)
        out[:, -1] = -100
        return out

    with torch.no_grad():
        sums = [model(input_ids=d, labels=labels_of(d))["mtp_loss"] * (d.shape[1] - 2) for d in docs]
        packed = model(
            input_ids=torch.cat(docs, dim=1),
            labels=torch.cat([labels_of(d) for d in docs], dim=1),
            position_ids=torch.cat([torch.arange(7), torch.arange(9)])[None],
        )["mtp_loss"]
    torch.testing.assert_close(packed * (7 - 2 + 9 - 2), sum(sums), atol=1e-5, rtol=1e-5)
