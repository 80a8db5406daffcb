"""Parallel plans: tensor, context, expert and data (FSDP2/HSDP) parallelism, activation
checkpointing, compile."""

from plait.models.common.parallel.activation_checkpointing import apply_activation_checkpointing
from plait.models.common.parallel.config import ActivationCheckpointing, ParallelConfig
from plait.models.common.parallel.plan import (
    LayerTensorParallel,
    apply_context_parallel,
    apply_expert_parallel,
    apply_fsdp,
    apply_tensor_parallel,
    parallelize_decoder,
    tp_gqa_layer,
)

__all__ = [
    "ActivationCheckpointing",
    "LayerTensorParallel",
    "ParallelConfig",
    "apply_activation_checkpointing",
    "apply_context_parallel",
    "apply_expert_parallel",
    "apply_fsdp",
    "apply_tensor_parallel",
    "parallelize_decoder",
    "tp_gqa_layer",
]
