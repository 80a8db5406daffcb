"""SIGTERM/SIGINT handling: finish the current step, save, exit within a grace period."""

from __future__ import annotations

import logging
import os
import signal
import threading
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


class PreemptionHandler:
    """Turns SIGTERM/SIGINT into a flag the training loop polls at step boundaries.

    :meth:`should_stop` agrees across ranks (an asynchronous max-reduction over ``process_group``,
    read one step later), so every rank stops after the same step and they save together. Once a signal arrives a watchdog ends the
    process after ``grace_period_s`` if the final save has not let it exit by then.
    """

    def __init__(
        self,
        grace_period_s: float = 120.0,
        process_group: dist.ProcessGroup | None = None,
        signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT),
    ) -> None:
        self.grace_period_s = grace_period_s
        self.pg = process_group
        self.received: int | None = None
        self._in_flight: tuple[torch.Tensor, Any] | None = None  # the last posted flag reduction
        self._previous = {s: signal.signal(s, self._on_signal) for s in signals}

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.received is not None:  # a second signal: stop waiting
            os._exit(128 + signum)
        self.received = signum
        log.warning(
            "received %s: finishing this step, saving, exiting within %.0f s",
            signal.Signals(signum).name,
            self.grace_period_s,
        )
        timer = threading.Timer(self.grace_period_s, os._exit, args=(128 + signum,))
        timer.daemon = True
        timer.start()

    def should_stop(self) -> bool:
        """True on every rank once any rank got a signal (call it once per step on every rank).

        Across ranks the flag travels in an asynchronous max-reduction over ``process_group``, posted
        at one call and read at the next, so no step waits for it: a signal stops every rank at the
        same step, one step after the rank that got it saw it. In a single process it is immediate.
        """
        flag = torch.tensor([0 if self.received is None else 1])
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size(self.pg) > 1):
            return bool(flag.item())
        previous = self._in_flight
        self._in_flight = (flag, dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.pg, async_op=True))
        if previous is None:
            return False
        agreed, work = previous
        work.wait()
        return bool(agreed.item())

    def restore(self) -> None:
        """Put the previous signal handlers back."""
        for s, handler in self._previous.items():
            signal.signal(s, handler)
