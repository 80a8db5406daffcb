"""Tiny Hugging Face Qwen3 / Qwen3-MoE checkpoints made offline for parity tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers

BASE: dict[str, Any] = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)
MOE: dict[str, Any] = dict(BASE, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2)


def make_hf(kind: str, tmp: Path, seed: int = 0, **overrides: Any) -> tuple[Path, Any]:
    """Build a random HF model (init std raised so numerics are not trivially near zero) and save it."""
    torch.manual_seed(seed)
    if kind == "dense":
        config = transformers.Qwen3Config(**{**BASE, **overrides})
        model = transformers.Qwen3ForCausalLM(config)
    else:
        config = transformers.Qwen3MoeConfig(**{**MOE, **overrides})
        model = transformers.Qwen3MoeForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.2)
    model.eval()
    path = tmp / f"hf_{kind}"
    model.save_pretrained(path)
    return path, model
