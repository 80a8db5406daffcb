"""Tiny, odd Hugging Face checkpoints of every family, made offline for parity tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers
from plait.models.gpt_oss import GptOssConfig, GptOssForCausalLM
from plait.models.llama import LlamaConfig, LlamaForCausalLM

_COMMON: dict[str, Any] = dict(
    vocab_size=97,
    hidden_size=36,
    intermediate_size=50,
    num_hidden_layers=3,
    num_attention_heads=6,
    num_key_value_heads=3,
    head_dim=6,
    max_position_embeddings=256,
)
_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 5000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
_GPT_OSS: dict[str, Any] = dict(
    _COMMON, intermediate_size=20, num_local_experts=5, num_experts_per_tok=2, sliding_window=4
)

_DEEPSEEK: dict[str, Any] = dict(
    _COMMON,
    num_key_value_heads=6,
    moe_intermediate_size=12,
    n_routed_experts=8,
    num_experts_per_tok=3,
    n_group=4,
    topk_group=2,
    n_shared_experts=2,
    first_k_dense_replace=1,
    kv_lora_rank=10,
    q_lora_rank=14,
    qk_nope_head_dim=6,
    qk_rope_head_dim=4,
    v_head_dim=5,
    routed_scaling_factor=2.5,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 1000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "mscale": 0.8,
        "mscale_all_dim": 0.9,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
    },
)
del _DEEPSEEK["head_dim"]

# Gated-DeltaNet hybrids: 2 key heads of 6 for 4 value heads of 5 (linear attention), a gated full
# attention layer in the middle, partial rotary of half of the head.
_HYBRID: dict[str, Any] = dict(
    _COMMON,
    head_dim=8,
    layer_types=["linear_attention", "full_attention", "linear_attention"],
    linear_conv_kernel_dim=3,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=6,
    linear_value_head_dim=5,
    rope_parameters={"rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": 0.5},
)
_HYBRID_MOE: dict[str, Any] = dict(
    _HYBRID,
    moe_intermediate_size=12,
    shared_expert_intermediate_size=14,
    num_experts=4,
    num_experts_per_tok=2,
)

# case -> (HF config class, HF model class, config kwargs)
CASES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(_COMMON, rope_parameters=_LLAMA3_ROPE)),
    "llama_mqa_tied_bias": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(_COMMON, num_key_value_heads=1, tie_word_embeddings=True, attention_bias=True, mlp_bias=True),
    ),
    "llama_yarn_4layers": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            _COMMON,
            num_hidden_layers=4,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 1000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        ),
    ),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", _GPT_OSS),
    "gpt_oss_full_first_mqa_tied": (
        "GptOssConfig",
        "GptOssForCausalLM",
        dict(
            _GPT_OSS,
            num_key_value_heads=1,
            tie_word_embeddings=True,
            sliding_window=5,
            layer_types=["full_attention", "sliding_attention", "sliding_attention"],
            num_experts_per_tok=3,
        ),
    ),
    # MLA with the q bottleneck, YaRN with DeepSeek's mscale, interleaved RoPE, 4 groups of 2 experts
    # of which 2 are kept, a dense first layer, 2 shared experts.
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", _DEEPSEEK),
    # A plain q_proj, half-split RoPE, no renormalisation, every layer MoE, no groups, tied.
    "deepseek_v3_no_q_lora_all_moe_tied": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(
            _DEEPSEEK,
            q_lora_rank=None,
            rope_interleave=False,
            norm_topk_prob=False,
            first_k_dense_replace=0,
            n_group=1,
            topk_group=1,
            n_shared_experts=1,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 500.0},
        ),
    ),
    # Two dense layers first, attention biases on the projections that have them, 8 groups of 1+1.
    "deepseek_v3_dense_first2": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(
            _DEEPSEEK,
            num_hidden_layers=4,
            first_k_dense_replace=2,
            attention_bias=True,
            n_group=2,
            topk_group=1,
            num_experts_per_tok=2,
        ),
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(_COMMON, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True),
    ),
}


# The gated-DeltaNet hybrids: their recurrence in fp32 (in transformers and in plait) differs by a few
# 1e-6 relative; tests/models/test_qwen3_5.py checks them with per-tensor relative tolerances.
HYBRID_CASES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "qwen3_5_text": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", _HYBRID),
    # One key head for three value heads, every layer MoE, tied embeddings, a 4-wide convolution.
    "qwen3_5_moe_text_tied": (
        "Qwen3_5MoeTextConfig",
        "Qwen3_5MoeForCausalLM",
        dict(
            {k: v for k, v in _HYBRID_MOE.items() if k != "intermediate_size"},
            linear_num_key_heads=1,
            linear_num_value_heads=3,
            linear_conv_kernel_dim=4,
            tie_word_embeddings=True,
        ),
    ),
    # The fused, per-key-head-grouped projections; a dense layer (mlp_only_layers) inside the MoE
    # model, no renormalisation of the top-k weights.
    "qwen3_next": (
        "Qwen3NextConfig",
        "Qwen3NextForCausalLM",
        dict(_HYBRID_MOE, mlp_only_layers=[1], norm_topk_prob=False),
    ),
}


def make_hf(case: str, tmp: Path, seed: int = 0) -> tuple[Path, Any]:
    """A random HF model of ``case`` (weights drawn wide enough that numerics are not near zero),
    saved under ``tmp``; returns its directory and the model (eval mode)."""
    cfg_cls, model_cls, kwargs = {**CASES, **HYBRID_CASES}[case]
    torch.manual_seed(seed)
    config = getattr(transformers, cfg_cls)(**kwargs)
    model = getattr(transformers, model_cls)(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif "sinks" in name:
                p.copy_(torch.randn_like(p))
            else:
                p.normal_(0.0, 0.2)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # a correction bias that changes the picks
                b.copy_(0.3 * torch.randn_like(b))
    model.eval()
    path = tmp / f"hf_{case}"
    model.save_pretrained(path)
    return path, model


# Small plait models of the new families for the layout tests (parallel, pipeline, context parallel):
# family -> (causal LM class, config class, config kwargs). Llama with attention biases; gpt-oss with
# a sliding window of 3 (layers 0 and 2; layer 1 full), sinks on every layer, biased experts.
SMALL: dict[str, tuple[type, type, dict[str, Any]]] = {
    "llama": (
        LlamaForCausalLM,
        LlamaConfig,
        dict(
            vocab_size=128,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            attention_bias=True,
            initializer_range=0.2,
        ),
    ),
    "gpt_oss": (
        GptOssForCausalLM,
        GptOssConfig,
        dict(
            vocab_size=128,
            hidden_size=32,
            intermediate_size=16,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            num_experts=4,
            num_experts_per_tok=2,
            sliding_window=3,
            router_aux_loss_coef=0.0,
            initializer_range=0.2,
        ),
    ),
}
