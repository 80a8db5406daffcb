"""Training FLOPs per token (for MFU): the helpers families compose their counts from.

Convention (PaLM / torchtitan): ``6 * active_params`` for the matmuls with weights, plus
``6 * 2 * context * (qk_dim + v_dim) / 2`` per head and layer for attention, counted without the
causal halving (``context`` is the sequence, or the window of a sliding-window layer).
"""

from __future__ import annotations

from typing import Protocol

from plait.models.common.config import DecoderConfig

__all__ = [
    "MoeFields",
    "attention_flops",
    "decoder_flops_per_token",
    "gqa_decoder_flops_per_token",
    "gqa_params",
    "mlp_params",
]


class MoeFields(Protocol):
    """The fields of a MoE config the counts read."""

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int


def gqa_params(config: DecoderConfig) -> int:
    """Weights of one grouped-query attention block (q, k, v, o projections)."""
    return config.hidden_size * config.resolved_head_dim * (config.num_attention_heads + config.kv_heads) * 2


def mlp_params(config: DecoderConfig, layer_idx: int, shared_intermediate: int = 0) -> int:
    """Weights one token multiplies with in layer ``layer_idx``'s feed-forward block: the dense
    SwiGLU, or ``top_k`` routed experts + the router + ``shared_intermediate`` of shared experts."""
    h = config.hidden_size
    if not config.is_moe_layer(layer_idx):
        return 3 * h * config.intermediate_size
    moe: MoeFields = config  # type: ignore[assignment]
    routed = moe.num_experts_per_tok * 3 * h * moe.moe_intermediate_size
    return routed + moe.num_experts * h + 3 * h * shared_intermediate


def attention_flops(heads: int, qk_dim: int, v_dim: int, context: int) -> float:
    """Forward + backward FLOPs per token of one layer's attention scores and weighted values."""
    return 6.0 * heads * context * (qk_dim + v_dim)


def decoder_flops_per_token(
    config: DecoderConfig,
    seq_len: int,
    layer_params: int,
    windows: list[int | None] | None = None,
    qk_dim: int | None = None,
    v_dim: int | None = None,
) -> float:
    """``6 * active_params + attention`` for a decoder of ``num_hidden_layers`` layers.

    Args:
        config: The model config.
        seq_len: Tokens per sequence.
        layer_params: Active weights of all decoder layers together (attention + feed-forward).
        windows: Per layer, the sliding window (None: full attention); default all full.
        qk_dim: Per-head query/key width (default ``resolved_head_dim``).
        v_dim: Per-head value width (default ``resolved_head_dim``).
    """
    active = layer_params + config.vocab_size * config.hidden_size  # + the LM head
    qk = qk_dim or config.resolved_head_dim
    v = v_dim or config.resolved_head_dim
    attn = 0.0
    for w in windows or [None] * config.num_hidden_layers:
        ctx = seq_len if w is None else min(w, seq_len)
        attn += attention_flops(config.num_attention_heads, qk, v, ctx)
    return float(6 * active + attn)


def gqa_decoder_flops_per_token(config: DecoderConfig, seq_len: int) -> float:
    """FLOPs per token of a decoder of grouped-query attention and SwiGLU / MoE layers (biases and
    sinks, a few parameters per layer, are not counted)."""
    layers = range(config.num_hidden_layers)
    params = sum(gqa_params(config) + mlp_params(config, i) for i in layers)
    return decoder_flops_per_token(config, seq_len, params, [config.sliding_window_of(i) for i in layers])
