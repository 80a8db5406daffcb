"""Training FLOPs per token of Qwen3.5 / Qwen3-Next: gated attention, gated DeltaNet, SwiGLU / MoE."""

from __future__ import annotations

from plait.models.common.config import DecoderConfig
from plait.models.common.flops import attention_flops, gqa_params, mlp_params
from plait.models.qwen3_5.config import Qwen3NextConfig, _HybridConfig

__all__ = ["gated_deltanet_params", "linear_attention_flops", "qwen3_5_flops_per_token"]


def gated_deltanet_params(config: _HybridConfig) -> int:
    """Weights of one gated DeltaNet: q/k/v/z/b/a projections, the convolution and ``out_proj``."""
    h = config.hidden_size
    key, value = (
        config.linear_num_key_heads * config.linear_key_head_dim,
        config.linear_num_value_heads * config.linear_value_head_dim,
    )
    conv = 2 * key + value
    return (
        h * (conv + value + 2 * config.linear_num_value_heads)
        + conv * config.linear_conv_kernel_dim
        + value * h
    )


def linear_attention_flops(config: _HybridConfig) -> float:
    """Forward + backward FLOPs per token of one layer's chunked gated delta rule (beyond its
    weights): per value head the state reads and write (``3 dk dv``) and the intra-chunk products
    with ``chunk`` tokens (``3 dk + 2 dv`` per token pair)."""
    dk, dv, c = config.linear_key_head_dim, config.linear_value_head_dim, config.linear_chunk_size
    return 6.0 * config.linear_num_value_heads * (3 * dk * dv + c * (3 * dk + 2 * dv))


def qwen3_5_flops_per_token(config: DecoderConfig, seq_len: int) -> float:
    """``6 * active_params`` (gated attention's doubled ``q_proj``, gated DeltaNet, SwiGLU or top-k
    routed + shared experts + router, the LM head) plus full attention over ``seq_len`` on the
    full-attention layers and the chunked delta rule on the linear ones."""
    assert isinstance(config, _HybridConfig)
    shared = config.shared_expert_intermediate_size if isinstance(config, Qwen3NextConfig) else 0
    gated_attn = (
        gqa_params(config) + config.hidden_size * config.resolved_head_dim * config.num_attention_heads
    )
    active = config.vocab_size * config.hidden_size
    mixing = 0.0
    hd = config.resolved_head_dim
    for i in range(config.num_hidden_layers):
        active += mlp_params(config, i, shared if config.is_moe_layer(i) else 0)
        if config.layer_type_of(i) == "linear_attention":
            active += gated_deltanet_params(config)
            mixing += linear_attention_flops(config)
        else:
            active += gated_attn
            mixing += attention_flops(config.num_attention_heads, hd, hd, seq_len)
    return float(6 * active + mixing)
