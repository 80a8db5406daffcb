"""plait.kernels: fused Triton kernels (SwiGLU, RMSNorm, linear cross-entropy, MoE permutation,
stochastic-rounding AdamW, grouped GEMM) and the split-backward switch.

Every op dispatches to Triton for CUDA tensors (and for CPU tensors under ``TRITON_INTERPRET=1``)
and to a plain-PyTorch implementation otherwise, so callers work on any device. The ops are torch
custom ops (namespace ``plait``) with fake implementations and registered autograd, so
``torch.compile`` traces models that use them without graph breaks. Importing the package tags
``torch.compile``'s caches with a digest of its source (:mod:`plait.kernels._compile_cache`).
"""

from plait.kernels._compile_cache import source_tag, tag_compile_caches
from plait.kernels.gmm import gmm, gmm_reference
from plait.kernels.grad_direction import GradDirection, current_grad_direction, grad_direction
from plait.kernels.linear_cross_entropy import linear_cross_entropy, linear_cross_entropy_reference
from plait.kernels.permute import RowIdMap, permute, permuted_rows, unpermute
from plait.kernels.rms_norm import rms_norm, rms_norm_reference
from plait.kernels.stochastic_rounding import StochasticAdamW, stochastic_round
from plait.kernels.swiglu import swiglu, swiglu_fused, swiglu_reference

tag_compile_caches(source_tag())

__all__ = [
    "GradDirection",
    "RowIdMap",
    "StochasticAdamW",
    "current_grad_direction",
    "gmm",
    "gmm_reference",
    "grad_direction",
    "linear_cross_entropy",
    "linear_cross_entropy_reference",
    "permute",
    "permuted_rows",
    "rms_norm",
    "rms_norm_reference",
    "stochastic_round",
    "swiglu",
    "swiglu_fused",
    "swiglu_reference",
    "unpermute",
]
