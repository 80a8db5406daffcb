"""Transformer building blocks: attention (and context-parallel attention), RoPE, RMSNorm, SwiGLU, embedding, heads, pooling."""

from plait.models.blocks.attention import (
    AttentionMask,
    GroupedQueryAttention,
    build_attention_mask,
    document_ids_from_position_ids,
    flash_attn_available,
)
from plait.models.blocks.context_parallel import ContextParallel, ContextParallelMask, ContextParallelMode
from plait.models.blocks.heads import LMHead, PoolingMethod, TokenEmbedding, pool_hidden_states
from plait.models.blocks.mlp import SwiGLUMLP
from plait.models.blocks.norm import RMSNorm
from plait.models.blocks.rope import RotaryEmbedding, apply_rotary, rope_inv_freq

__all__ = [
    "AttentionMask",
    "ContextParallel",
    "ContextParallelMask",
    "ContextParallelMode",
    "GroupedQueryAttention",
    "LMHead",
    "PoolingMethod",
    "RMSNorm",
    "RotaryEmbedding",
    "SwiGLUMLP",
    "TokenEmbedding",
    "apply_rotary",
    "build_attention_mask",
    "document_ids_from_position_ids",
    "flash_attn_available",
    "pool_hidden_states",
    "rope_inv_freq",
]
