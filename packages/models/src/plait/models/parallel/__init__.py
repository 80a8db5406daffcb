"""Parallel plans: tensor, context, expert and data (FSDP2/HSDP) parallelism, checkpointing, compile."""

from plait.models.parallel.checkpointing import apply_activation_checkpointing
from plait.models.parallel.config import ActivationCheckpointing, ParallelConfig
from plait.models.parallel.plan import (
    apply_context_parallel,
    apply_expert_parallel,
    apply_fsdp,
    apply_tensor_parallel,
    parallelize,
)

__all__ = [
    "ActivationCheckpointing",
    "ParallelConfig",
    "apply_activation_checkpointing",
    "apply_context_parallel",
    "apply_expert_parallel",
    "apply_fsdp",
    "apply_tensor_parallel",
    "parallelize",
]
