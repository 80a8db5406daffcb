"""This rank's place in the batch domain (pp, dp, cp, tp), read from a distributed context, and the
device and context a training run starts from (:func:`pick_device`, :func:`connect`)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from plait.dist_core import DeviceMeshParameters, DistributedContext, shard_batch
from plait.loop.config import dp_size_of

__all__ = ["Topology", "connect", "pick_device"]


@dataclass(frozen=True)
class Topology:
    """Ranks, sizes and process groups the loop needs (where each pipeline stage runs is another
    thing: :class:`plait.pipelining.StageTopology`).

    Attributes:
        rank / world_size: global.
        dp_rank / dp_size / dp_group: the batch domain's data-parallel dimension (data shards).
        pp_rank / pp_size / pp_group: the pipeline dimension.
        cp_rank / cp_size / cp_group: the context-parallel dimension (the ranks that share each
            sample, every one holding its shard of the sequence; :meth:`shard_batch`).
        coords / sizes: every batch-mesh dimension's coordinate and size (for log prefixes).
        groups: every process group of the mesh (for collective timeouts).
    """

    rank: int = 0
    world_size: int = 1
    dp_rank: int = 0
    dp_size: int = 1
    dp_group: dist.ProcessGroup | None = None
    pp_rank: int = 0
    pp_size: int = 1
    pp_group: dist.ProcessGroup | None = None
    cp_rank: int = 0
    cp_size: int = 1
    cp_group: dist.ProcessGroup | None = None
    coords: dict[str, int] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)
    groups: tuple[dist.ProcessGroup, ...] = ()

    @property
    def is_main(self) -> bool:
        """Global rank 0 (the rank that writes logs and trackers)."""
        return self.rank == 0

    def shard_batch(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's context shard of every ``[B, T, ...]`` tensor of ``batch`` (the batch itself
        without context parallelism); see :func:`plait.dist_core.shard_batch`."""
        if self.cp_size == 1:
            return batch
        return shard_batch(batch, self.cp_size, self.cp_rank)

    @classmethod
    def from_context(cls, ctx: DistributedContext) -> Topology:
        """From a distributed context (its ``batch`` mesh: pp, dp, cp, tp)."""
        mesh = ctx.mesh_for("batch")
        names = tuple(mesh.mesh_dim_names or ())
        coord = mesh.get_coordinate() or [0] * len(names)
        coords = {n: int(c) for n, c in zip(names, coord)}
        sizes = {n: int(mesh[n].size()) for n in names}
        groups = {n: (mesh[n].get_group() if sizes[n] > 1 else None) for n in names}
        return cls(
            rank=dist.get_rank() if dist.is_initialized() else 0,
            world_size=dist.get_world_size() if dist.is_initialized() else 1,
            dp_rank=coords.get("dp", 0),
            dp_size=sizes.get("dp", 1),
            dp_group=groups.get("dp"),
            pp_rank=coords.get("pp", 0),
            pp_size=sizes.get("pp", 1),
            pp_group=groups.get("pp"),
            cp_rank=coords.get("cp", 0),
            cp_size=sizes.get("cp", 1),
            cp_group=groups.get("cp"),
            coords=coords,
            sizes=sizes,
            groups=tuple(g for g in groups.values() if g is not None),
        )

    @classmethod
    def data_parallel(cls) -> Topology:
        """Pure data parallelism over the default group (or a single process when not distributed)."""
        if not (dist.is_available() and dist.is_initialized()):
            return cls()
        rank, world = dist.get_rank(), dist.get_world_size()
        return cls(
            rank=rank,
            world_size=world,
            dp_rank=rank,
            dp_size=world,
            dp_group=dist.group.WORLD if world > 1 else None,
            coords={"dp": rank},
            sizes={"dp": world},
        )


def pick_device(device: torch.device | str) -> torch.device:
    """``device``; a CUDA device without an index becomes this process's (``LOCAL_RANK``, default 0),
    made the current CUDA device."""
    dev = torch.device(str(device))
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(dev)
    return dev


def connect(
    ctx: DistributedContext | None, mesh: DeviceMeshParameters, device: torch.device, init_timeout_s: float
) -> tuple[DistributedContext, Topology]:
    """The distributed context and this rank's :class:`Topology` in it.

    Args:
        ctx: the context; None builds one with ``DistributedContext.from_env(mesh)`` (torchrun's
            environment, or a single process, which creates no process group).
        mesh: the mesh of a context built here.
        device: the device of a context built here.
        init_timeout_s: the collective timeout of a context built here: start-up collectives (weight
            loading, compilation) run under the long init timeout.

    Raises:
        ValueError: the context's dp size is not the ``mesh``'s (``data_replicate x data_shard``).
    """
    if ctx is None:
        ctx = DistributedContext.from_env(mesh, device=device, timeout=init_timeout_s)
    single = getattr(ctx, "world_size", None) == 1 and not dist.is_initialized()
    topology = Topology() if single else Topology.from_context(ctx)
    if topology.dp_size != dp_size_of(mesh):
        raise ValueError(
            f"mesh: the batch domain's dp size is {topology.dp_size} but the config's mesh section gives "
            f"data_replicate x data_shard = {dp_size_of(mesh)}"
        )
    return ctx, topology
