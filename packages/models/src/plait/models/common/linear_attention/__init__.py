"""Linear attention: gated DeltaNet (the gated delta rule, its short convolution, the gated norm),
in PyTorch with optional fla-core kernels."""

from plait.models.common.linear_attention.conv import causal_conv1d
from plait.models.common.linear_attention.delta_rule import (
    chunk_gated_delta_rule,
    l2norm,
    recurrent_gated_delta_rule,
)
from plait.models.common.linear_attention.fla import FLA_EXTRA, cu_seqlens_from_document_ids, fla_available
from plait.models.common.linear_attention.gated_deltanet import (
    GatedDeltaNet,
    LinearAttentionImplementation,
    ProjectionLayout,
)
from plait.models.common.linear_attention.norm import GatedRMSNorm

__all__ = [
    "FLA_EXTRA",
    "GatedDeltaNet",
    "GatedRMSNorm",
    "LinearAttentionImplementation",
    "ProjectionLayout",
    "causal_conv1d",
    "chunk_gated_delta_rule",
    "cu_seqlens_from_document_ids",
    "fla_available",
    "l2norm",
    "recurrent_gated_delta_rule",
]
