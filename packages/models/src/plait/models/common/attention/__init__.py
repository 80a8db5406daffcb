"""Attention: masks, kernels, the attention call, grouped-query attention, context parallelism."""

from plait.models.common.attention.context import (
    ContextParallel,
    ContextParallelMask,
    ContextParallelMode,
    allgather_latent_attention,
    context_attention,
)
from plait.models.common.attention.core import attention
from plait.models.common.attention.gqa import GroupedQueryAttention
from plait.models.common.attention.kernels import (
    AttentionKernels,
    apply_sinks,
    flash_attn_available,
    sink_reference_attention,
)
from plait.models.common.attention.mask import (
    AttentionMask,
    build_attention_mask,
    document_ids_from_position_ids,
    isolate_padding,
    padding_mask,
)

__all__ = [
    "AttentionKernels",
    "AttentionMask",
    "ContextParallel",
    "ContextParallelMask",
    "ContextParallelMode",
    "GroupedQueryAttention",
    "allgather_latent_attention",
    "apply_sinks",
    "attention",
    "build_attention_mask",
    "context_attention",
    "document_ids_from_position_ids",
    "flash_attn_available",
    "isolate_padding",
    "padding_mask",
    "sink_reference_attention",
]
