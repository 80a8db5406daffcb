"""A heartbeat file: the main rank's latest step, time, tokens and phase, for a watchdog outside the job.

``<run_dir>/heartbeat.json`` is rewritten atomically (a temporary file, then ``os.replace``) so a reader
never sees half a file; after a step it is rewritten at most every ``logging.heartbeat_interval_s``
seconds, at phase changes (start, checkpoint, evaluation, end) always. It holds::

    {"step": 120, "total_steps": 1000, "tokens_seen": 491520, "phase": "training",
     "time": 1767225600.5, "pid": 4242}

``time`` is the unix time of the write: a reader that sees it older than a few step times knows the
main rank's loop is stuck (or the job is gone); ``phase`` says what it was doing.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from plait.loop.events import EventBus, StepEnd, TrainingEnd, TrainingStart

__all__ = ["HEARTBEAT_FILE", "Heartbeat"]

HEARTBEAT_FILE = "heartbeat.json"

logger = logging.getLogger("plait.loop")


class Heartbeat:
    """Writes ``heartbeat.json`` into the run directory from the training loop's events.

    It follows :class:`~plait.loop.events.TrainingStart` (phase ``starting``),
    :class:`~plait.loop.events.StepEnd` (``training``, throttled) and
    :class:`~plait.loop.events.TrainingEnd` (``finished`` or ``stopped``); :meth:`phase` marks a
    checkpoint save or an evaluation, :meth:`beat` anything else (e.g. ``failed``). Without a
    ``path`` (other ranks than the main one, or ``logging.heartbeat_interval_s=None``) it writes nothing.

    Args:
        path: the heartbeat file, or None for none.
        interval_s: the least time between two writes after steps (0: after every step).
        events: the bus whose events it follows (None: only explicit :meth:`beat` calls).
        clock: the unix-time clock (tests pass their own).
    """

    def __init__(
        self,
        path: Path | None,
        interval_s: float = 10.0,
        events: EventBus | None = None,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.path = path
        self.interval_s = interval_s
        self._clock = clock
        self._last_write: float | None = None
        self._step = 0
        self._total_steps: int | None = None
        self._tokens = 0
        self._warned = False
        if path is not None and events is not None:
            events.subscribe(TrainingStart, self._on_start)
            events.subscribe(StepEnd, self._on_step_end)
            events.subscribe(TrainingEnd, self._on_end)

    @classmethod
    def for_run(
        cls, run_dir: Path, interval_s: float | None, events: EventBus, *, is_main: bool
    ) -> Heartbeat:
        """The run's heartbeat: on the main rank ``run_dir/heartbeat.json`` unless ``interval_s`` is None."""
        path = run_dir / HEARTBEAT_FILE if is_main and interval_s is not None else None
        return cls(path, interval_s or 0.0, events)

    def _on_start(self, e: TrainingStart) -> None:
        self._total_steps, self._tokens = e.total_steps, e.tokens_seen
        self.beat(e.step, "starting", force=True)

    def _on_step_end(self, e: StepEnd) -> None:
        self._tokens = e.tokens_seen
        self.beat(e.step, "training")

    def _on_end(self, e: TrainingEnd) -> None:
        self.beat(e.step, "stopped" if e.stopped_early else "finished", force=True)

    def beat(self, step: int, phase: str, *, force: bool = False) -> bool:
        """Write the heartbeat unless the last write is younger than ``interval_s`` (and not ``force``).

        A failed write (full disk, ...) is logged once and otherwise ignored: the heartbeat never stops
        the training.

        Returns:
            Whether the file was written.
        """
        self._step = step
        if self.path is None:
            return False
        now = self._clock()
        if not force and self._last_write is not None and now - self._last_write < self.interval_s:
            return False
        record = {
            "step": step,
            "total_steps": self._total_steps,
            "tokens_seen": self._tokens,
            "phase": phase,
            "time": now,
            "pid": os.getpid(),
        }
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        try:
            tmp.write_text(json.dumps(record))
            os.replace(tmp, self.path)
        except OSError as err:
            if not self._warned:
                logger.warning("heartbeat not written to %s: %s", self.path, err.strerror or err)
                self._warned = True
            return False
        self._last_write = now
        return True

    @contextlib.contextmanager
    def phase(self, name: str, step: int) -> Iterator[None]:
        """Mark a phase (``checkpoint``, ``evaluation``) in the heartbeat while it runs, then ``training``."""
        self.beat(step, name, force=True)
        try:
            yield
        finally:
            self.beat(step, "training", force=True)
