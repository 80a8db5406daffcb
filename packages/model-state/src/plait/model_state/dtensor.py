"""DTensor helpers: local views, meta checks and local-shard arithmetic (no communication but
:func:`full_tensor`).

They live here, in the package every other plait package that handles parameters may import
(peft and models depend on model-state), and accept plain tensors too, so callers need no
``isinstance(t, DTensor)`` branches of their own.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import Placement

from .specs import Region, slice_region

__all__ = ["full_tensor", "is_meta", "local_region", "local_shard", "local_view", "to_dtensor"]


def local_view(t: torch.Tensor) -> torch.Tensor:
    """This rank's local tensor of a DTensor (aliasing its storage), or ``t`` itself if plain.

    A wrapper tensor subclass that keeps its values in one inner tensor (torchao's float8
    all-gather weights) has no storage of its own: the inner tensor is returned.
    """
    local = t.to_local() if isinstance(t, DTensor) else t
    flatten = getattr(local, "__tensor_flatten__", None)
    if flatten is not None:
        names, _ = flatten()
        if len(names) == 1:
            return local_view(getattr(local, names[0]))
    return local


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole logical tensor (a collective on DTensors: every rank of the mesh must call it)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def is_meta(t: torch.Tensor) -> bool:
    """Whether ``t`` (its local tensor, for a DTensor) lives on the meta device."""
    return local_view(t).is_meta


def local_region(
    global_shape: Sequence[int], mesh: DeviceMesh, placements: Sequence[Placement]
) -> Region | None:
    """The box of the global tensor this rank holds, or ``None`` when the shard is not a box.

    Plain ``Shard``/``Replicate`` placements give a box (one contiguous range per dim), so a
    reader can fetch exactly those bytes. Strided shards (FSDP over TP) and ``Partial`` do not.
    """
    if any(not (type(p) is Shard or isinstance(p, Replicate)) for p in placements):
        return None
    shape, offset = compute_local_shape_and_global_offset(tuple(global_shape), mesh, placements)
    if len(offset) != len(global_shape):  # rank outside the mesh
        return None
    return tuple((int(o), int(o) + int(s)) for o, s in zip(offset, shape))


def local_shard(full: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement]) -> torch.Tensor:
    """This rank's local shard of ``full`` (every rank holds ``full``; nothing is communicated)."""
    region = local_region(full.shape, mesh, placements)
    if region is not None:
        return slice_region(full, region)
    if full.device.type != mesh.device_type:
        full = full.to(mesh.device_type)
    return distribute_tensor(full, mesh, placements, src_data_rank=None).to_local()


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(int(s), 1)
    return tuple(reversed(stride))


def to_dtensor(
    local: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement], global_shape: Sequence[int]
) -> DTensor:
    """Wrap an already-computed local shard as a DTensor of ``global_shape`` (no communication)."""
    if local.device.type != mesh.device_type:
        local = local.to(mesh.device_type)
    return DTensor.from_local(
        local.contiguous(),
        mesh,
        list(placements),
        run_check=False,
        shape=torch.Size(global_shape),
        stride=_contiguous_stride(global_shape),
    )
