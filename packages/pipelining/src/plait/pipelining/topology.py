"""Stage-to-rank placement: loop (round-robin, circular when a rank holds several stages) and V-shape."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["StageTopology", "loop_topology", "vshape_topology"]


@dataclass(frozen=True)
class StageTopology:
    """Which rank of the pipeline group runs each stage (``plait.loop.Topology`` is another thing: a
    rank's coordinates and process groups in the batch mesh).

    Attributes:
        num_ranks: pipeline-parallel group size (pp).
        stage_to_rank: ``stage_to_rank[s]`` is the pp-rank running global stage ``s``.
        style: ``"loop"`` or ``"v"`` (informational; schedules check it).
    """

    num_ranks: int
    stage_to_rank: tuple[int, ...]
    style: Literal["loop", "v"] = "loop"

    def __post_init__(self) -> None:
        if self.num_ranks < 1:
            raise ValueError(f"StageTopology.num_ranks must be >= 1, got {self.num_ranks}")
        bad = [r for r in self.stage_to_rank if not 0 <= r < self.num_ranks]
        if bad:
            raise ValueError(f"StageTopology.stage_to_rank has ranks outside [0, {self.num_ranks}): {bad}")
        missing = set(range(self.num_ranks)) - set(self.stage_to_rank)
        if missing:
            raise ValueError(f"StageTopology leaves ranks {sorted(missing)} without a stage")

    @property
    def num_stages(self) -> int:
        return len(self.stage_to_rank)

    @property
    def stages_per_rank(self) -> int:
        return self.num_stages // self.num_ranks

    def rank_of(self, stage: int) -> int:
        """The pp-rank running `stage`."""
        if not 0 <= stage < self.num_stages:
            raise ValueError(f"stage {stage} out of range [0, {self.num_stages})")
        return self.stage_to_rank[stage]

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """Global stage indices held by `rank`, ascending."""
        if not 0 <= rank < self.num_ranks:
            raise ValueError(f"rank {rank} out of range [0, {self.num_ranks})")
        return tuple(s for s, r in enumerate(self.stage_to_rank) if r == rank)

    def is_local_edge(self, stage: int) -> bool:
        """Whether stage and stage+1 live on the same rank (no communication between them)."""
        return self.rank_of(stage) == self.rank_of(stage + 1)


def loop_topology(num_ranks: int, stages_per_rank: int = 1) -> StageTopology:
    """Stage ``s`` on rank ``s % num_ranks``: layers wrap around the ranks `stages_per_rank` times."""
    if stages_per_rank < 1:
        raise ValueError(f"stages_per_rank must be >= 1, got {stages_per_rank}")
    return StageTopology(num_ranks, tuple(s % num_ranks for s in range(num_ranks * stages_per_rank)), "loop")


def vshape_topology(num_ranks: int) -> StageTopology:
    """Rank ``r`` holds stages ``r`` and ``2*num_ranks-1-r`` (down the ranks, then back up)."""
    stage_to_rank = tuple(range(num_ranks)) + tuple(reversed(range(num_ranks)))
    return StageTopology(num_ranks, stage_to_rank, "v")
