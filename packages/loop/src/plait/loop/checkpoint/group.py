"""The collectives a checkpoint's phases use, over the checkpoint's process group (or none)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["CheckpointGroup", "initialised"]


def initialised() -> bool:
    """Whether a default process group exists."""
    return dist.is_available() and dist.is_initialized()


class CheckpointGroup:
    """Rank, barrier, broadcast and any-rank flag over ``pg`` (the default group when None); without
    an initialised process group each is the one-process answer.

    Args:
        pg: the process group the checkpoint coordinates over.
    """

    def __init__(self, pg: dist.ProcessGroup | None) -> None:
        self.pg = pg

    @property
    def rank(self) -> int:
        """This process's rank in the group."""
        return dist.get_rank(self.pg) if initialised() else 0

    @property
    def world_size(self) -> int:
        """The number of ranks of the group."""
        return dist.get_world_size(self.pg) if initialised() else 1

    def barrier(self) -> None:
        """Wait for every rank."""
        if initialised():
            dist.barrier(group=self.pg)

    def broadcast(self, obj: Any) -> Any:
        """The group's first rank's ``obj``, on every rank."""
        if not initialised():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.pg, 0) if self.pg else 0, group=self.pg)
        return box[0]

    def any(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is true on any rank."""
        if not initialised():
            return flag
        t = torch.tensor([int(flag)])
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.pg)
        return bool(t.item())

    def all_keys(self, keys: list[str]) -> list[list[str]]:
        """Every rank's ``keys``."""
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, keys, group=self.pg)
        return out
