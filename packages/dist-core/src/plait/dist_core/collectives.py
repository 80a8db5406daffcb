"""Collective helpers: objects, tensors whose shapes differ per rank, and scalar reductions.

Every function takes ``group`` (a ProcessGroup, default: the world) or a ``DeviceMesh`` plus a
dimension name. They are collective: every rank of the group must call them in the same order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

ReduceOp = Literal["sum", "mean", "max", "min"]
_OPS = {
    "sum": dist.ReduceOp.SUM,
    "mean": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}

GroupLike = dist.ProcessGroup | DeviceMesh | None


def _group(group: GroupLike, dim: str | int | None) -> dist.ProcessGroup | None:
    if isinstance(group, DeviceMesh):
        if dim is None:
            if group.ndim != 1:
                raise ValueError(f"a {group.ndim}-D mesh needs dim=<name>; its dims: {group.mesh_dim_names}")
            return group.get_group()
        return group.get_group(dim)
    if dim is not None:
        raise ValueError("dim= is only meaningful with a DeviceMesh")
    return group


def _comm_device(group: dist.ProcessGroup | None) -> torch.device:
    # NCCL groups need CUDA tensors; gloo groups take CPU tensors.
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_object(obj: Any, group: GroupLike = None, dim: str | int | None = None) -> list[Any]:
    """Gather a picklable object from every rank of the group; index = group rank."""
    pg = _group(group, dim)
    out: list[Any] = [None] * dist.get_world_size(pg)
    dist.all_gather_object(out, obj, group=pg)
    return out


def _shapes(tensor: torch.Tensor, pg: dist.ProcessGroup | None) -> list[torch.Size]:
    meta = all_gather_object((tuple(tensor.shape), tensor.dtype), pg)
    dtypes = {d for _, d in meta}
    if len(dtypes) != 1:
        raise ValueError(f"ranks gathered tensors of different dtypes: {[str(d) for _, d in meta]}")
    return [torch.Size(s) for s, _ in meta]


def _padded(tensor: torch.Tensor, numel: int, device: torch.device) -> torch.Tensor:
    flat = tensor.detach().reshape(-1).to(device)
    out = torch.zeros(numel, dtype=tensor.dtype, device=device)
    out[: flat.numel()] = flat
    return out


def all_gather_uneven(
    tensor: torch.Tensor, group: GroupLike = None, dim: str | int | None = None
) -> list[torch.Tensor]:
    """All-gather tensors whose shapes (even number of dimensions) differ per rank.

    Shapes are exchanged first, then every tensor is flattened and zero-padded to the largest
    size for one ``all_gather``. Dtypes must match.

    Returns:
        One tensor per group rank, with that rank's shape, on ``tensor``'s device.
    """
    pg = _group(group, dim)
    shapes = _shapes(tensor, pg)
    numel = max(s.numel() for s in shapes)
    device = _comm_device(pg)
    buffers = [torch.empty(numel, dtype=tensor.dtype, device=device) for _ in shapes]
    dist.all_gather(buffers, _padded(tensor, numel, device), group=pg)
    return [b[: s.numel()].reshape(s).to(tensor.device) for b, s in zip(buffers, shapes, strict=True)]


def gather_uneven(
    tensor: torch.Tensor, dst: int = 0, group: GroupLike = None, dim: str | int | None = None
) -> list[torch.Tensor] | None:
    """Gather tensors of per-rank shapes to group rank ``dst``.

    Returns:
        On ``dst``: one tensor per group rank with its shape; on other ranks: ``None``.
    """
    pg = _group(group, dim)
    shapes = _shapes(tensor, pg)
    numel = max(s.numel() for s in shapes)
    device = _comm_device(pg)
    is_dst = dist.get_rank(pg) == dst
    buffers = [torch.empty(numel, dtype=tensor.dtype, device=device) for _ in shapes] if is_dst else None
    global_dst = dist.get_global_rank(pg, dst) if pg is not None else dst
    dist.gather(_padded(tensor, numel, device), buffers, dst=global_dst, group=pg)
    if buffers is None:
        return None
    return [b[: s.numel()].reshape(s).to(tensor.device) for b, s in zip(buffers, shapes, strict=True)]


def reduce_scalar(
    value: float | torch.Tensor,
    op: ReduceOp = "sum",
    group: GroupLike = None,
    dim: str | int | Sequence[str] | None = None,
) -> float:
    """Reduce a Python or 0-d tensor scalar over a group, or over one or more mesh dimensions.

    With a mesh and several dims, the reduction runs dim by dim (sum/max/min compose; mean
    divides the sum by the product of the dims' sizes).

    Args:
        value: the local scalar.
        op: ``"sum"``, ``"mean"``, ``"max"`` or ``"min"``.
        group: a ProcessGroup (default world) or a DeviceMesh.
        dim: mesh dimension name(s) when ``group`` is a mesh.

    Returns:
        The reduced value as a Python float, equal on every rank of the group.
    """
    if op not in _OPS:
        raise ValueError(f"unknown reduction {op!r}; valid: {', '.join(_OPS)}")
    if isinstance(value, torch.Tensor) and value.numel() != 1:
        raise ValueError(f"reduce_scalar takes a scalar, got a tensor of shape {tuple(value.shape)}")
    dims: list[Any] = list(dim) if isinstance(dim, list | tuple) else [dim]
    groups = [_group(group, d) for d in dims]
    x = torch.as_tensor(value, dtype=torch.float64).reshape(1)
    size = 1
    for pg in groups:
        # float64 on CPU, float32 on NCCL devices that lack fast float64 reductions.
        device = _comm_device(pg)
        t = x.to(device=device, dtype=torch.float64 if device.type == "cpu" else torch.float32)
        dist.all_reduce(t, op=_OPS[op], group=pg)
        x = t.to("cpu", torch.float64)
        size *= dist.get_world_size(pg)
    result = float(x.item())
    return result / size if op == "mean" else result
