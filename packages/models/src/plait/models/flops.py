"""Training FLOPs per token (for MFU)."""

from __future__ import annotations

from plait.models.config import Qwen3Config, Qwen3MoeConfig

__all__ = ["active_params", "flops_per_token"]


def active_params(config: Qwen3Config, *, include_embedding: bool = False) -> int:
    """Parameters one token's forward multiplies with (routed experts counted ``top_k`` times)."""
    h, d = config.hidden_size, config.resolved_head_dim
    attn = h * d * (config.num_attention_heads * 2 + config.kv_heads * 2)
    total = 0
    for i in range(config.num_hidden_layers):
        total += attn
        if config.is_moe_layer(i):
            assert isinstance(config, Qwen3MoeConfig)
            total += (
                config.num_experts_per_tok * 3 * h * config.moe_intermediate_size + config.num_experts * h
            )
        else:
            total += 3 * h * config.intermediate_size
    total += config.vocab_size * h  # LM head
    if include_embedding:
        total += config.vocab_size * h
    return total


def flops_per_token(config: Qwen3Config, seq_len: int) -> float:
    """Forward + backward FLOPs per token: ``6 * active_params + 12 * L * heads * head_dim * seq_len``
    (the PaLM / torchtitan convention; attention counted without the causal halving)."""
    attn = 12 * config.num_hidden_layers * config.num_attention_heads * config.resolved_head_dim * seq_len
    return float(6 * active_params(config) + attn)
