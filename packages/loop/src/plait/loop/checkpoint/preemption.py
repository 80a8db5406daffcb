"""SIGTERM/SIGINT handling: finish the current step, save, exit within a grace period."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None


def _call_previous(handler: Handler, signum: int, frame: FrameType | None) -> None:
    """Do what the handler that was installed before would have done with ``signum``."""
    if callable(handler):
        handler(signum, frame)
    elif handler == signal.SIG_DFL:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


class PreemptionHandler:
    """Turns SIGTERM/SIGINT into a flag the training loop polls at step boundaries.

    :meth:`should_stop` agrees across ranks (an asynchronous max-reduction over ``process_group``,
    read one step later), so every rank stops after the same step and they save together. Once a signal arrives a watchdog ends the
    process after ``grace_period_s`` if the final save has not let it exit by then.

    Signals within ``repeat_window_s`` of the first count as that one: a Ctrl-C under ``uv run``
    reaches the process twice (the terminal's SIGINT to the process group, then uv's forwarded copy
    about 200 ms later). A signal after the window aborts at once (exit status 128 + its number), also
    after :meth:`restore`, which hands later signals back to the previous handlers.
    """

    def __init__(
        self,
        grace_period_s: float = 120.0,
        process_group: dist.ProcessGroup | None = None,
        signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT),
        repeat_window_s: float = 2.0,
    ) -> None:
        self.grace_period_s = grace_period_s
        self.repeat_window_s = repeat_window_s
        self.pg = process_group
        self.received: int | None = None
        self._received_at = 0.0  # time.monotonic() of the first signal
        self._in_flight: tuple[torch.Tensor, Any] | None = None  # the last posted flag reduction
        # Log records of the handler, written by the next should_stop(): a handler runs inside whatever the
        # main thread was doing, possibly a write to the same stream, and a line written from it there can
        # be lost or glued to another.
        self._logs: list[tuple[int, str, tuple[object, ...]]] = []
        self._previous = {s: signal.signal(s, self._on_signal) for s in signals}

    def _is_repeat(self, signum: int) -> bool:
        """A signal within the window after the first one (logged, then ignored)."""
        if self.received is None or time.monotonic() - self._received_at > self.repeat_window_s:
            return False
        self._logs.append((logging.INFO, "%s again within %.0f s: taken as the same stop request",
                           (signal.Signals(signum).name, self.repeat_window_s)))  # fmt: skip
        return True

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self._is_repeat(signum):
            return
        if self.received is not None:  # a second signal after the window: stop waiting
            os._exit(128 + signum)
        self.received = signum
        self._received_at = time.monotonic()
        self._logs.append((
            logging.WARNING,
            "received %s: finishing this step, saving, exiting within %.0f s (again after %.0f s: abort)",
            (signal.Signals(signum).name, self.grace_period_s, self.repeat_window_s),
        ))  # fmt: skip
        timer = threading.Timer(self.grace_period_s, os._exit, args=(128 + signum,))
        timer.daemon = True
        timer.start()

    def should_stop(self) -> bool:
        """True on every rank once any rank got a signal (call it once per step on every rank).

        Across ranks the flag travels in an asynchronous max-reduction over ``process_group``, posted
        at one call and read at the next, so no step waits for it: a signal stops every rank at the
        same step, one step after the rank that got it saw it. In a single process it is immediate.
        """
        self._write_logs()
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

    def _write_logs(self) -> None:
        while self._logs:
            level, msg, args = self._logs.pop(0)
            log.log(level, msg, *args)

    def restore(self) -> None:
        """Put the previous signal handlers back; after a signal, repeats of it within the window are
        still ignored (the run is saving and exiting), later ones go to the previous handlers."""
        self._write_logs()
        for s, handler in self._previous.items():
            signal.signal(s, handler if self.received is None else self._after_restore(handler))

    def _after_restore(self, previous: Handler) -> Callable[[int, FrameType | None], None]:
        def on_signal(signum: int, frame: FrameType | None) -> None:
            if not self._is_repeat(signum):
                _call_previous(previous, signum, frame)

        return on_signal
