"""Training FLOPs per token of DeepSeek-V3 (MLA projections and attention, dense and MoE layers)."""

from __future__ import annotations

from plait.models.common.config import DecoderConfig
from plait.models.common.flops import attention_flops, decoder_flops_per_token, mlp_params
from plait.models.deepseek_v3.config import DeepseekV3Config

__all__ = ["deepseek_v3_flops_per_token", "mla_params"]


def mla_params(config: DeepseekV3Config) -> int:
    """Weights of one multi-head latent attention block: the query projection(s), the latent
    ``kv_a_proj_with_mqa``, its expansion ``kv_b_proj`` and ``o_proj`` (norms not counted)."""
    h, heads = config.hidden_size, config.num_attention_heads
    if config.q_lora_rank is None:
        q = h * heads * config.qk_head_dim
    else:
        q = h * config.q_lora_rank + config.q_lora_rank * heads * config.qk_head_dim
    kv_a = h * (config.kv_lora_rank + config.qk_rope_head_dim)
    kv_b = config.kv_lora_rank * heads * (config.qk_nope_head_dim + config.v_head_dim)
    o = heads * config.v_head_dim * h
    return q + kv_a + kv_b + o


def deepseek_v3_flops_per_token(config: DecoderConfig, seq_len: int) -> float:
    """``6 * active_params`` (MLA, dense SwiGLU or top-k routed + shared experts + router, LM head)
    plus attention with ``qk_head_dim`` scores and ``v_head_dim`` values per head; trained MTP
    modules add their ``eh_proj``, decoder layer, LM head and attention."""
    assert isinstance(config, DeepseekV3Config)
    shared = config.n_shared_experts * config.moe_intermediate_size
    params = sum(
        mla_params(config) + mlp_params(config, i, shared if config.is_moe_layer(i) else 0)
        for i in range(config.num_hidden_layers)
    )
    total = decoder_flops_per_token(
        config, seq_len, params, qk_dim=config.qk_head_dim, v_dim=config.v_head_dim
    )
    for i in config.mtp_layer_ids:  # eh_proj, the MoE decoder layer, the LM head, attention
        mtp = 2 * config.hidden_size**2 + mla_params(config) + mlp_params(config, i, shared)
        mtp += config.vocab_size * config.hidden_size
        heads, qk, v = config.num_attention_heads, config.qk_head_dim, config.v_head_dim
        total += 6 * mtp + attention_flops(heads, qk, v, seq_len)
    return total
