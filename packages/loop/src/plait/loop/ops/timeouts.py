"""Separate collective timeouts for start-up and for steady-state steps."""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Iterable
from typing import Any, Protocol, runtime_checkable

import torch.distributed as dist

__all__ = ["SetsTimeouts", "set_collective_timeout"]


@runtime_checkable
class SetsTimeouts(Protocol):
    """A context that sets the timeout of every group it uses (:class:`~plait.dist_core.DistributedContext`)."""

    def set_timeout(self, seconds: float) -> None:
        """Set the collective timeout of the context's groups."""
        ...


def set_collective_timeout(seconds: float, groups: Iterable[Any] = (), ctx: object = None) -> None:
    """Set the timeout of the default process group and of ``groups`` (no-op when not distributed),
    or, given a ``ctx`` with a ``set_timeout`` method (a :class:`~plait.dist_core.DistributedContext`),
    of every group the context uses, through it.

    Start-up (weight loading, compilation) runs under the long ``timeouts.init_s``; the trainer
    switches to ``timeouts.step_s`` after the first step so a hung rank is detected quickly.
    """
    if isinstance(ctx, SetsTimeouts):
        ctx.set_timeout(seconds)
        return
    if not (dist.is_available() and dist.is_initialized()):
        return
    from torch.distributed.distributed_c10d import _set_pg_timeout

    td = datetime.timedelta(seconds=seconds)
    seen: set[int] = set()
    for g in [None, *groups]:
        if id(g) in seen:
            continue
        seen.add(id(g))
        # Some backends/groups (e.g. a fake or non-member group) do not support changing it.
        with contextlib.suppress(RuntimeError, ValueError):
            _set_pg_timeout(td, g)
