"""Gradient synchronisation of plain (non-DTensor) parameters and DTensor-aware norm/clipping."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["all_reduce_plain_grads", "clip_grad_norm", "prepare_fsdp_for_sum"]


def prepare_fsdp_for_sum(modules: Sequence[nn.Module]) -> int:
    """Make FSDP2 reduce gradients by *sum* (divide factor 1); returns the number of FSDP modules.

    The loop normalises the loss by the global token count itself, so the data-parallel reduction
    must add, not average, the ranks' gradients.
    """
    from torch.distributed.fsdp import FSDPModule

    n = 0
    for root in modules:
        for m in root.modules():
            if isinstance(m, FSDPModule):
                m.set_gradient_divide_factor(1.0)
                n += 1
    return n


def all_reduce_plain_grads(params: Iterable[nn.Parameter], group: Any, bucket_size_mb: float = 25.0) -> None:
    """Sum the gradients of non-DTensor parameters over ``group`` in flat buckets.

    A parameter without a gradient on this rank (unused this step) contributes zeros, so every rank
    issues the same collectives.
    """
    plain = [p for p in params if p.requires_grad and not isinstance(p, DTensor)]
    if not plain:
        return
    for p in plain:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    by_dtype: dict[tuple[torch.dtype, torch.device], list[nn.Parameter]] = defaultdict(list)
    for p in plain:
        by_dtype[(p.grad.dtype, p.grad.device)].append(p)  # type: ignore[union-attr]
    limit = max(int(bucket_size_mb * 2**20), 1)
    for (dtype, _), ps in sorted(by_dtype.items(), key=lambda kv: str(kv[0])):
        bucket: list[nn.Parameter] = []
        size = 0
        for p in ps:
            bucket.append(p)
            size += p.numel() * dtype.itemsize
            if size >= limit:
                _reduce_bucket(bucket, group)
                bucket, size = [], 0
        if bucket:
            _reduce_bucket(bucket, group)


def _reduce_bucket(bucket: list[nn.Parameter], group: Any) -> None:
    grads = [p.grad for p in bucket if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[offset : offset + n].view_as(g))
        offset += n


def _group_key(t: torch.Tensor) -> Any:
    if isinstance(t, DTensor):
        return (id(t.device_mesh), tuple(t.placements), t.device.type)
    return (None, (), t.device.type)


@torch.no_grad()
def clip_grad_norm(
    params: Iterable[nn.Parameter], max_norm: float | None, norm_type: float = 2.0, pp_group: Any = None
) -> torch.Tensor:
    """Global gradient norm over DTensor and plain gradients (and pipeline stages), then clip.

    Gradients are grouped by mesh and placements (DTensors on different meshes, e.g. dense vs.
    expert parameters, cannot be stacked), each group's norm is made global with ``full_tensor()``,
    and the pipeline stages' norms are combined over ``pp_group``.

    Returns:
        The total norm before clipping (a 0-d float32 tensor on the gradients' device).
    """
    params = [p for p in params if p.grad is not None]
    groups: dict[Any, list[torch.Tensor]] = defaultdict(list)
    for p in params:
        groups[_group_key(p.grad)].append(p.grad)  # type: ignore[arg-type]
    device = params[0].grad.device if params else torch.device("cpu")  # type: ignore[union-attr]
    # A rank without gradients (an empty stage) still joins the pipeline reduction below.
    norms = [torch.zeros((), device=device)]
    for grads in groups.values():
        n = torch.nn.utils.get_total_norm(grads, norm_type=norm_type)
        if isinstance(n, DTensor):
            n = n.full_tensor()
        norms.append(n.float().to(device))
    stacked = torch.stack(norms)
    if math.isinf(norm_type):
        total = stacked.max()
        if pp_group is not None:
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=pp_group)
    else:
        total_p = (stacked**norm_type).sum()
        if pp_group is not None:
            dist.all_reduce(total_p, op=dist.ReduceOp.SUM, group=pp_group)
        total = total_p ** (1.0 / norm_type)
    if max_norm is not None:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total
