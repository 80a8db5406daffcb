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
        if not _GATHERING:
            _GATHERING.append((group, group.group_name))
        symm_mem.rendezvous(output_tensor, group=group.group_name)  # a lookup once the buffer is registered
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


# The one process group (and its name) this process gathers into symmetric memory over, once it has.
_GATHERING: list[tuple[dist.ProcessGroup, str]] = []


def symmetric_memory_unavailable(group: dist.ProcessGroup) -> str | None:
    """Why FSDP2's all-gathers over ``group`` cannot use NCCL symmetric memory here, or None if they can
    (the backend, the torch, the NCCL version, or :func:`_other_group`)."""
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
    return _other_group(group)


def _other_group(group: dist.ProcessGroup) -> str | None:
    """Why ``group`` cannot: this process already gathers into symmetric memory over another process group.

    One group per process, the one of the process's first model that gathered. torch keeps a buffer's
    registration with a group under the group's *name* for the life of the buffer, its pool keeps the
    buffers for every group, and after ``destroy_process_group`` new groups get the old names back: on two
    GPUs a second model trained in the same processes after their groups were made again crashed (a segfault),
    and a second model over new groups in the same processes (with CUDA graphs) ended with weights beyond
    bf16 tolerance of the same training with FSDP2's own all-gather."""
    if not _GATHERING or _GATHERING[0][0] is group:
        return None
    return (
        f"this process already gathers into symmetric memory over another process group "
        f"({_GATHERING[0][1]!r}, of an earlier model): one group per process"
    )


def use_symmetric_all_gather(module: FSDPModule) -> None:
    """Gather ``module``'s own FSDP2 parameter groups into symmetric memory (not recursive, like
    ``fully_shard``). Check :func:`symmetric_memory_unavailable` first."""
    symm_mem.set_backend("NCCL")
    module.set_custom_all_gather(SymmetricAllGather())
