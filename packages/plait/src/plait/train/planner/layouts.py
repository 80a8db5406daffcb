"""The layouts ``plait plan`` considers: mesh degrees, pipeline schedule, microbatch size, checkpointing."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

from plait.dist_core import DeviceMeshParameters

__all__ = ["CHECKPOINTING", "SCHEDULES", "Layout", "candidate_layouts", "divisors"]

# Pipeline schedules and their stages per rank (the looped and V-shaped ones hold two).
SCHEDULES: tuple[tuple[str, int], ...] = (
    ("gpipe", 1),
    ("1f1b", 1),
    ("interleaved_1f1b", 2),
    ("zb1p", 1),
    ("zbv", 2),
    ("dualpipev", 2),
)
CHECKPOINTING = ("none", "selective", "full")


def divisors(n: int) -> list[int]:
    """The divisors of ``n``, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class Layout:
    """One way to run the job on ``world`` GPUs.

    Attributes:
        pp, dp_replicate, dp_shard, cp, tp: the mesh degrees (``cp`` is ``context_shard``).
        ep: expert parallelism over the data and context ranks (1 for dense models).
        schedule: the pipeline schedule (``None`` without pipeline parallelism).
        stages_per_rank: model stages per pipeline rank (2 for the looped and V schedules).
        microbatch_size: samples per forward/backward on one rank.
        checkpointing: activation checkpointing of every decoder layer: none, selective or full.
    """

    pp: int
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    ep: int
    schedule: str | None
    stages_per_rank: int
    microbatch_size: int
    checkpointing: str

    @property
    def world(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    def mesh(self) -> DeviceMeshParameters:
        return DeviceMeshParameters(
            pipeline=self.pp,
            data_replicate=self.dp_replicate,
            data_shard=self.dp_shard,
            context_shard=self.cp,
            tensor=self.tp,
            expert=self.ep,
        )

    def pipeline_options(self) -> dict[str, object] | None:
        """The ``[pipeline]`` section of this layout (None without pipeline parallelism)."""
        if self.schedule is None:
            return None
        options: dict[str, object] = {"kind": self.schedule}
        if self.schedule in ("interleaved_1f1b", "looped_bfs"):
            options["stages_per_rank"] = self.stages_per_rank
        return options

    def overrides(self) -> list[str]:
        """The ``plait train`` overrides that run this layout."""
        out = [
            f"--mesh.pipeline={self.pp}",
            f"--mesh.data_replicate={self.dp_replicate}",
            f"--mesh.data_shard={self.dp_shard}",
            f"--mesh.context_shard={self.cp}",
            f"--mesh.tensor={self.tp}",
            f"--mesh.expert={self.ep}",
            f"--batching.microbatch_size={self.microbatch_size}",
            f"--parallel.activation_checkpointing.mode={self.checkpointing}",
        ]
        for key, value in (self.pipeline_options() or {}).items():
            out.append(f"--pipeline.{key}={value}")
        return out

    @property
    def name(self) -> str:
        parts = [f"pp{self.pp}"] if self.pp > 1 else []
        if self.dp_replicate > 1:
            parts.append(f"dpr{self.dp_replicate}")
        parts.append(f"fsdp{self.dp_shard}")
        parts += [f"cp{self.cp}"] if self.cp > 1 else []
        parts += [f"tp{self.tp}"] if self.tp > 1 else []
        parts += [f"ep{self.ep}"] if self.ep > 1 else []
        parts += [self.schedule] if self.schedule else []
        parts += [f"mb{self.microbatch_size}", f"ac-{self.checkpointing}"]
        return " ".join(parts)


def candidate_layouts(
    world: int,
    *,
    global_batch_size: int,
    num_experts: int | None,
    gpus_per_node: int,
    checkpointing: tuple[str, ...] = CHECKPOINTING,
) -> Iterator[Layout]:
    """Every combination of degrees whose product is ``world`` (``tp`` within a node, ``dp_replicate`` only
    across nodes), ``ep`` dividing both the data x context ranks and the experts, each schedule for
    ``pp > 1``, each microbatch size that divides the per-rank batch, each checkpointing mode. Whether a
    candidate is valid is for the job's own checks to say (:func:`plait.train.planner.plan`)."""
    nodes = max(1, world // gpus_per_node)
    for pp, dpr, cp, tp in itertools.product(
        divisors(world), divisors(nodes), divisors(world), divisors(world)
    ):
        if world % (pp * dpr * cp * tp) or tp > gpus_per_node:
            continue
        dps = world // (pp * dpr * cp * tp)
        eps = [e for e in divisors(dpr * dps * cp) if num_experts and num_experts % e == 0] or [1]
        schedules = [(s, k) for s, k in SCHEDULES] if pp > 1 else [(None, 1)]
        dp = dpr * dps
        if global_batch_size % dp:
            continue
        for ep, (sched, spr), mb, ac in itertools.product(
            eps, schedules, divisors(global_batch_size // dp), checkpointing
        ):
            yield Layout(pp, dpr, dps, cp, tp, ep, sched, spr, mb, ac)
