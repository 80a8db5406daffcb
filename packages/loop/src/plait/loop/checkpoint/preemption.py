"""SIGTERM/SIGINT handling: finish the current step, save, exit within a grace period."""

from __future__ import annotations

import logging
import os
import signal
import threading
from types import FrameType

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


class PreemptionHandler:
    """Turns SIGTERM/SIGINT into a flag the training loop polls at step boundaries.

    :meth:`should_stop` agrees across ranks (a max-reduction over ``process_group``), so every rank
    stops after the same step and they save together. Once a signal arrives a watchdog ends the
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
        """True on every rank once any rank got a signal."""
        flag = torch.tensor([0 if self.received is None else 1])
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.pg)
        return bool(flag.item())

    def restore(self) -> None:
        """Put the previous signal handlers back."""
        for s, handler in self._previous.items():
            signal.signal(s, handler)
