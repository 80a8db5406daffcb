"""FSDP2's gradient copy-in without a host cost that grows with the gradients' size.

Before each reduce-scatter, FSDP2 copies a unit's unsharded gradients into one ``[world, n]`` buffer
(row ``r``: every gradient's ``r``-th dim-0 chunk, side by side) with ``torch._chunk_cat``. On CUDA that
op builds its launch metadata on the host with one entry per 2 KiB thread block of the whole buffer:
~1.6 ms of host time per GiB of gradients, in the backward, where a host-bound step waits for it (a
1.14B MoE of two FSDP units on 2 x H200 spent 4.9 ms of its ~75 ms step there, profiled with the GPU
idle meanwhile).

:func:`install` replaces FSDP2's copy-in function with one concatenation, gradients whose first dim
the world size divides: ``torch.cat([grad.view(world, n) for grad in grads], dim=1, out=out)`` (the same
bytes in the same places; one batched kernel, which on 2 x H200 took half the GPU time of one strided
copy per gradient and less than ``_chunk_cat``'s). Anything else (uneven first dims, which
``_chunk_cat`` pads; mixed dtypes; non-contiguous gradients) goes to FSDP2's own function. ``tests/dist_core/test_fsdp_copy_in.py``
checks the result against ``torch._chunk_cat`` and that the patched name still exists in the installed
torch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.fsdp._fully_shard import _fsdp_collectives

__all__ = ["copy_in", "install"]

_ORIGINAL: Callable[[list[torch.Tensor], torch.Tensor, int], None] = (
    _fsdp_collectives.foreach_reduce_scatter_copy_in
)


def copy_in(unsharded_grads: list[torch.Tensor], reduce_scatter_input: torch.Tensor, world_size: int) -> None:
    """Write the gradients into ``reduce_scatter_input`` as ``torch._chunk_cat(grads, 0, world_size)`` does."""
    out = reduce_scatter_input.view(world_size, -1)
    if sum(g.numel() for g in unsharded_grads) != out.numel() or not all(
        g.dtype == out.dtype and g.dim() > 0 and g.shape[0] % world_size == 0 and g.is_contiguous()
        for g in unsharded_grads
    ):
        _ORIGINAL(unsharded_grads, reduce_scatter_input, world_size)
        return
    torch.cat([g.view(world_size, -1) for g in unsharded_grads], dim=1, out=out)


def install() -> None:
    """Make FSDP2 use :func:`copy_in` (idempotent; process-wide, like ``fully_shard`` itself)."""
    _fsdp_collectives.foreach_reduce_scatter_copy_in = copy_in
