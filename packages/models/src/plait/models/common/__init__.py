"""The trunk every family is built from: config fields, RoPE, norms, MLPs, attention (masks,
kernels, context parallelism), the decoder layer and stages, heads, parallel plans, FLOPs."""

from plait.models.common.attention import (
    AttentionKernels,
    AttentionMask,
    ContextParallel,
    ContextParallelMask,
    ContextParallelMode,
    GroupedQueryAttention,
    build_attention_mask,
    document_ids_from_position_ids,
    flash_attn_available,
)
from plait.models.common.config import AttentionImplementation, DecoderConfig, RopeParameters
from plait.models.common.family import Family
from plait.models.common.heads import LMHead, PoolingMethod, TokenEmbedding, pool_hidden_states
from plait.models.common.layer import AttentionModule, DecoderLayer, DenseMLP, SequentialMixer
from plait.models.common.mlp import SwiGLUMLP
from plait.models.common.model import (
    CausalLMStage,
    DecoderStage,
    DecoderTrunk,
    LayerFactory,
    SequenceClassifierStage,
    stage_layer_ids,
)
from plait.models.common.norm import RMSNorm
from plait.models.common.rope import RotaryEmbedding, apply_rotary, rope_inv_freq

__all__ = [
    "AttentionImplementation",
    "AttentionKernels",
    "AttentionMask",
    "AttentionModule",
    "CausalLMStage",
    "ContextParallel",
    "ContextParallelMask",
    "ContextParallelMode",
    "DecoderConfig",
    "DecoderLayer",
    "DecoderStage",
    "DecoderTrunk",
    "DenseMLP",
    "Family",
    "GroupedQueryAttention",
    "LMHead",
    "LayerFactory",
    "PoolingMethod",
    "RMSNorm",
    "RopeParameters",
    "RotaryEmbedding",
    "SequenceClassifierStage",
    "SequentialMixer",
    "SwiGLUMLP",
    "TokenEmbedding",
    "apply_rotary",
    "build_attention_mask",
    "document_ids_from_position_ids",
    "flash_attn_available",
    "pool_hidden_states",
    "rope_inv_freq",
    "stage_layer_ids",
]
