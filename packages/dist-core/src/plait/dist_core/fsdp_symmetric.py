"""FSDP2's all-gathers into NCCL symmetric memory.

FSDP2 gathers each unit's parameters into a staging buffer from the caching allocator, and NCCL runs the
all-gather with its regular kernels, which take SMs from the matmuls beside them. With the buffer taken
from torch's symmetric-memory pool (``torch.distributed._symmetric_memory``, NCCL backend) and registered
with the group, NCCL runs its symmetric kernels (or, with ``NCCL_CTA_POLICY=2``, its copy engines) on it,
which take fewer SMs: on 2 x H200 the dense Qwen3-1.7B FSDP2 step ran 0.7-1.3% faster
(``benchmarks/results/scaling.md``). The buffers come from the pool, which keeps them for the next
all-gather of the same size (peak allocated memory unchanged).

torch >= 2.12 has this as ``FSDPModule.set_symm_mem_for_comm``; :func:`use_symmetric_all_gather` sets the
same through ``set_custom_all_gather``, which older torch has too. Only the all-gather: FSDP2's
symmetric reduce-scatter supports sums only (no averaging or PreMulSum).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather

try:
    from torch.distributed import _symmetric_memory as symm_mem
except ImportError:  # a torch without it: symmetric_memory_unavailable says so
    symm_mem = None  # type: ignore[assignment]

__all__ = ["SymmetricAllGather", "symmetric_memory_unavailable", "use_symmetric_all_gather"]

_MIN_NCCL = (2, 27)  # NCCL's symmetric-memory windows


class SymmetricAllGather(AllGather):
    """FSDP2's all-gather with its output buffer in the symmetric-memory pool, registered with the group."""

    def allocate(
        self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
    ) -> Any:
        pool = symm_mem.get_mem_pool(device)
        assert isinstance(pool, torch.cuda.MemPool), pool  # NCCL: a CUDA device
        with torch.cuda.use_mem_pool(pool):
            return torch.empty(size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> Any:
        _REGISTERED.setdefault(group.group_name, group)
        symm_mem.rendezvous(output_tensor, group=group.group_name)  # a lookup once the buffer is registered
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


# The process groups this process registered symmetric buffers with, by name.
_REGISTERED: dict[str, dist.ProcessGroup] = {}


def symmetric_memory_unavailable(group: dist.ProcessGroup) -> str | None:
    """Why FSDP2's all-gathers over ``group`` cannot use NCCL symmetric memory here, or None if they can
    (the backend, the torch, the NCCL version, or :func:`_name_reused`)."""
    backend = str(dist.get_backend(group)).lower()
    if backend != "nccl":
        return f"the data-parallel group's backend is {backend}, not nccl"
    if symm_mem is None:
        return f"torch {torch.__version__} has no torch.distributed._symmetric_memory"
    if not hasattr(symm_mem, "get_mem_pool") or not hasattr(torch.cuda, "use_mem_pool"):
        return f"torch {torch.__version__} has no symmetric-memory pool"
    nccl = torch.cuda.nccl.version()
    if nccl < _MIN_NCCL:
        return f"NCCL {'.'.join(map(str, nccl))} is older than {'.'.join(map(str, _MIN_NCCL))}"
    return _name_reused(group)


def _name_reused(group: dist.ProcessGroup) -> str | None:
    """Why ``group`` cannot: torch keeps a buffer's registration with a group under the group's *name* for
    the life of the buffer (and its pool keeps the buffers), while after ``destroy_process_group`` new groups
    get the old names back. A new group of an earlier registered group's name would gather through the
    destroyed group's registrations: on two GPUs a second model built so crashed (a segfault)."""
    earlier = _REGISTERED.get(group.group_name)
    if earlier is None or earlier is group:
        return None
    return (
        f"this process registered symmetric buffers with an earlier process group named {group.group_name!r} "
        "(destroyed since), and torch keeps those registrations under the name"
    )


def use_symmetric_all_gather(module: FSDPModule) -> None:
    """Gather ``module``'s own FSDP2 parameter groups into symmetric memory (not recursive, like
    ``fully_shard``). Check :func:`symmetric_memory_unavailable` first."""
    symm_mem.set_backend("NCCL")
    module.set_custom_all_gather(SymmetricAllGather())
