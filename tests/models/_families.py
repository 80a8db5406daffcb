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
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(_COMMON, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True),
    ),
}


def make_hf(case: str, tmp: Path, seed: int = 0) -> tuple[Path, Any]:
    """A random HF model of ``case`` (weights drawn wide enough that numerics are not near zero),
    saved under ``tmp``; returns its directory and the model (eval mode)."""
    cfg_cls, model_cls, kwargs = CASES[case]
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
