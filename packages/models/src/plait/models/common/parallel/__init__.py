"""Parallel plans: float8 training, tensor, context, expert and data (FSDP2/HSDP) parallelism, activation
checkpointing, compile."""

from plait.models.common.parallel.activation_checkpointing import apply_activation_checkpointing
from plait.models.common.parallel.config import ActivationCheckpointing, Float8Training, ParallelConfig
from plait.models.common.parallel.float8 import (
    Float8Conversion,
    apply_float8,
    check_float8,
    float8_linears,
    precompute_float8_scales,
)
from plait.models.common.parallel.plan import (
    LayerTensorParallel,
    apply_context_parallel,
    apply_data_parallel,
    apply_expert_parallel,
    apply_fsdp,
    apply_tensor_parallel,
    check_context_parallel,
    parallelize_decoder,
    tp_gqa_layer,
)

__all__ = [
    "ActivationCheckpointing",
    "Float8Conversion",
    "Float8Training",
    "LayerTensorParallel",
    "ParallelConfig",
    "apply_activation_checkpointing",
    "apply_context_parallel",
    "apply_data_parallel",
    "apply_expert_parallel",
    "apply_float8",
    "apply_fsdp",
    "apply_tensor_parallel",
    "check_context_parallel",
    "check_float8",
    "float8_linears",
    "parallelize_decoder",
    "precompute_float8_scales",
    "tp_gqa_layer",
]
