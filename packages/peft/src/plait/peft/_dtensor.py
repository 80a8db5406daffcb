"""Helpers that let merge/unmerge work on plain tensors and on FSDP2/TP DTensor parameters alike.

Merging never all-gathers a base weight when it can avoid it: the adapter factors are small, so
each rank gathers them, cuts out the rows/columns that match its own shard of the base weight
(``Replicate -> Shard`` redistribution is a local chunk, no communication) and computes only its
local slice of ``B @ A``. Placements this does not understand (``_StridedShard`` from FSDP+TP
compositions) take the plain path: full delta, then the local chunk of it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from plait.model_state import local_view
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

__all__ = ["assign_full", "local_chunk", "simple_placements"]


def simple_placements(placements: Sequence[Placement]) -> bool:
    """True if every placement is a plain ``Shard(d)`` or ``Replicate()``."""
    return all(type(p) is Shard or type(p) is Replicate for p in placements)


def local_chunk(full: torch.Tensor, like: DTensor, dim_map: Mapping[int, int] | None = None) -> torch.Tensor:
    """This rank's chunk of ``full`` laid out like ``like``'s placements.

    Args:
        full: the same tensor on every rank.
        like: DTensor whose mesh and placements define the chunking.
        dim_map: maps ``like``'s sharded dims to ``full``'s dims (``Shard(d)`` on a dim missing from
            the map becomes ``Replicate``). None: identical layout.
    """
    mesh = like.device_mesh
    if dim_map is None:
        placements: list[Placement] = list(like.placements)
    else:
        placements = [
            Shard(dim_map[p.dim]) if type(p) is Shard and p.dim in dim_map else Replicate()
            for p in like.placements
        ]
    rep = DTensor.from_local(full, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return rep.redistribute(mesh, placements).to_local()


def assign_full(param: torch.Tensor, full: torch.Tensor) -> None:
    """Write the whole tensor ``full`` into ``param`` (for a DTensor only this rank's shard, no communication)."""
    if tuple(full.shape) != tuple(param.shape):
        raise ValueError(f"shape {tuple(full.shape)} does not fit a parameter of shape {tuple(param.shape)}")
    dst = local_view(param)
    src = full.to(device=dst.device, dtype=dst.dtype)
    if isinstance(param, DTensor):
        src = local_chunk(src, param)
    with torch.no_grad():
        dst.copy_(src)
