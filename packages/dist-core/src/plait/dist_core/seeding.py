"""Deterministic per-rank seeds derived from a base seed and the rank's mesh coordinates.

Which coordinates a seed depends on decides where randomness differs and where it matches:

============  ===========================  ==========================================  ===============================
kind          varies with                  equal across                                use it for
============  ===========================  ==========================================  ===============================
``"model"``   pp stage                     dp, cp, tp (and so ep) ranks                parameter initialisation
``"data"``    dp coordinate                pp stages, cp and tp ranks of one replica   sampling, shuffling, augmentation
``"compute"`` pp stage, dp and cp coords   tp ranks                                    dropout and other noise in forward
============  ===========================  ==========================================  ===============================

- ``"model"``: every data/context/tensor-parallel rank of a stage draws the same initial values
  (DTensor sharding then takes each rank's part), while stages hold different layers and draw
  independent streams.
- ``"data"``: the ranks that consume one batch (all pipeline stages, context and tensor peers of
  one replica) must choose the same samples; replicas choose different ones.
- ``"compute"``: tokens differ across dp and cp ranks, layers across pp stages, so their noise is
  independent; tensor-parallel peers hold replicated activations and must draw the same masks.

Expert-parallel ranks are data/context ranks, so they follow the dp/cp rules. Seeds are
``sha256(base, kind, coordinates)`` truncated to 63 bits: stable across runs, machines and Python
versions, and independent of the world size for the coordinates that matter.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from typing import Literal

import torch
from plait.dist_core.context import DistributedContext
from torch import nn

SeedKind = Literal["model", "data", "compute"]

_SEED_DIMS: dict[str, tuple[str, ...]] = {
    "model": ("pp",),
    "data": ("dp",),
    "compute": ("pp", "dp", "cp"),
}


def seed_from_coordinates(base_seed: int, kind: SeedKind, coordinates: dict[str, int]) -> int:
    """The seed of ``kind`` for a rank at ``coordinates`` of the batch domain (``pp, dp, cp, tp``).

    Only the coordinates listed for ``kind`` in the module table are used; others are ignored.

    Raises:
        ValueError: unknown ``kind`` or a needed coordinate is missing.
    """
    if kind not in _SEED_DIMS:
        raise ValueError(f"unknown seed kind {kind!r}; valid kinds: {', '.join(_SEED_DIMS)}")
    try:
        parts = [f"{dim}={int(coordinates[dim])}" for dim in _SEED_DIMS[kind]]
    except KeyError as e:
        raise ValueError(
            f"seed kind {kind!r} needs coordinate {e.args[0]!r}, got {sorted(coordinates)}"
        ) from None
    text = ":".join([str(int(base_seed)), kind, *parts])
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


def seed_for(base_seed: int, ctx: DistributedContext, kind: SeedKind = "compute") -> int:
    """This rank's seed of ``kind`` (see the module table) derived from ``base_seed``."""
    return seed_from_coordinates(base_seed, kind, ctx.coordinates("batch"))


def set_seed(base_seed: int, ctx: DistributedContext, kind: SeedKind = "compute") -> int:
    """Seed torch (CPU and CUDA) and Python's ``random`` with :func:`seed_for`; returns the seed."""
    seed = seed_for(base_seed, ctx, kind)
    random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device
    return seed


def init_as_one_process(module: nn.Module, init: Callable[[], None]) -> None:
    """Run ``init`` (which initialises ``module``'s parameters in place, e.g. its ``reset_parameters``) so
    that every DTensor parameter on a CPU mesh ends up with its part of the values one process draws.

    torch draws a sharded DTensor's random numbers per shard only on CUDA-like meshes; on a CPU mesh each
    rank draws its local shard as if it were the whole tensor, so the shards of a weight repeat each other
    (the rows of a router, say, come in identical copies). Here each such parameter is swapped for a plain
    tensor of its full shape while ``init`` runs (the same numbers in the same order as one process, from
    the same seed on every rank), then each rank keeps its part (``distribute_tensor`` of the full values,
    no communication). Costs the memory of those parameters unsharded, during ``init`` only. DTensors on
    other meshes are left to torch's sharded random numbers.
    """
    from torch.distributed.tensor import DTensor, distribute_tensor

    swapped: list[tuple[nn.Module, str, DTensor]] = []
    full: dict[int, tuple[DTensor, nn.Parameter]] = {}  # id -> (the DTensor, its full stand-in)
    for m in module.modules():
        for name, p in list(m.named_parameters(recurse=False)):
            if isinstance(p, DTensor) and p.device_mesh.device_type == "cpu":
                if id(p) not in full:
                    local = p.to_local()
                    values = torch.empty(p.shape, dtype=local.dtype, device=local.device)
                    full[id(p)] = (p, nn.Parameter(values, p.requires_grad))
                setattr(m, name, full[id(p)][1])
                swapped.append((m, name, p))
    try:
        init()
    finally:
        for m, name, sharded in swapped:
            setattr(m, name, sharded)
    with torch.no_grad():
        for sharded, values in full.values():
            part = distribute_tensor(
                values.detach(), sharded.device_mesh, sharded.placements, src_data_rank=None
            )
            sharded.to_local().copy_(part.to_local())
