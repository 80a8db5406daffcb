"""Stragglers: which rank the others wait for, gathered once per logging interval on the host group.

Each rank measures, over the interval, its wall time, the time it spent blocked in the step's host
synchronisation (the loss-token count all-reduce at the start of every step: ranks that arrive early
wait there for the late one) and the time it waited for batches. Its *busy time* per step is the wall
time less the synchronisation wait: the rank that arrives last has the most. One all-gather of four
floats per rank on the gloo group (no device work, no device sync) brings every rank's figures to every
rank; the slowest rank, its lag over the median (the lower median for an even rank count) and its data
wait become metrics, and a warning when the lag passes ``logging.straggler_threshold``.

What it sees is host time: a slow data loader, a busy or throttled CPU, a slow file system, garbage
collection, a rank whose Python work is late. On GPUs a slow device is not seen (all hosts wait for
their devices alike); under pipeline parallelism the stages' work differs by design.

Test hooks, read once, here, when the trainer is built:

- ``PLAIT_DEBUG_RANK_DELAY`` (``"RANK:SECONDS[,RANK:SECONDS...]"``, e.g. ``"1:0.2"``) makes the named
  ranks sleep that long at the start of every step, before the batch is fetched.
- ``PLAIT_DEBUG_RANK_HANG`` (``"RANK:STEP"`` or ``"RANK:STEP:stop"``, e.g. ``"1:4"``) makes rank ``RANK``
  stop making progress at the start of the step after ``STEP`` completed steps, in the first attempt of
  a job only (``TORCHELASTIC_RESTART_COUNT`` unset or 0, so that a restarted group runs through): it
  sleeps until it is ended, or with ``stop`` sends itself SIGSTOP (a process frozen by the system).
"""

from __future__ import annotations

import logging
import os
import signal
import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from plait.loop.events import EventBus, StepEnd, StepStart, TrainingStart

__all__ = [
    "RANK_DELAY_ENV",
    "RANK_HANG_ENV",
    "RankHang",
    "StragglerMeter",
    "StragglerReport",
    "find_straggler",
    "rank_delay_from_env",
    "rank_hang_from_env",
]

RANK_DELAY_ENV = "PLAIT_DEBUG_RANK_DELAY"
RANK_HANG_ENV = "PLAIT_DEBUG_RANK_HANG"

logger = logging.getLogger("plait.loop")


def rank_delay_from_env(rank: int, environ: Mapping[str, str] = os.environ) -> float:
    """The seconds ``PLAIT_DEBUG_RANK_DELAY`` asks ``rank`` to sleep per step (0.0 when it names no such rank).

    Raises:
        ValueError: a malformed value, naming the variable.
    """
    text = environ.get(RANK_DELAY_ENV, "").strip()
    delay = 0.0
    for item in filter(None, (part.strip() for part in text.split(","))):
        try:
            r, seconds = item.split(":")
            r_int, s = int(r), float(seconds)
        except ValueError:
            raise ValueError(
                f"{RANK_DELAY_ENV}={text!r}: expected RANK:SECONDS[,RANK:SECONDS...], e.g. '1:0.2'"
            ) from None
        if s < 0:
            raise ValueError(f"{RANK_DELAY_ENV}={text!r}: the delay of rank {r_int} is negative")
        if r_int == rank:
            delay = s
    return delay


@dataclass(frozen=True)
class RankHang:
    """What ``PLAIT_DEBUG_RANK_HANG`` asks of this rank: hang at the start of the step after ``step``
    completed steps, by sleeping (``stop=False``) or by SIGSTOP (``stop=True``)."""

    step: int
    stop: bool = False


def rank_hang_from_env(rank: int, environ: Mapping[str, str] = os.environ) -> RankHang | None:
    """The hang ``PLAIT_DEBUG_RANK_HANG`` asks of ``rank``; None when it names another rank, is unset, or
    this process belongs to a restarted torchrun group (``TORCHELASTIC_RESTART_COUNT`` > 0).

    Raises:
        ValueError: a malformed value, naming the variable.
    """
    text = environ.get(RANK_HANG_ENV, "").strip()
    if not text:
        return None
    parts = text.split(":")
    try:
        if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] != "stop"):
            raise ValueError
        r_int, step = int(parts[0]), int(parts[1])
        if step < 0:
            raise ValueError
    except ValueError:
        raise ValueError(
            f"{RANK_HANG_ENV}={text!r}: expected RANK:STEP or RANK:STEP:stop, e.g. '1:4'"
        ) from None
    if r_int != rank or int(environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0:
        return None
    return RankHang(step, stop=len(parts) == 3)


@dataclass(frozen=True)
class StragglerReport:
    """The slowest rank of one logging interval.

    Attributes:
        rank: the rank with the most busy time per step.
        lag_s: its busy time per step less the median rank's (seconds).
        lag_frac: ``lag_s`` over the median's busy time per step.
        data_wait_s: its wait for batches per step (seconds): a large share of ``lag_s`` points at its data.
        flagged: ``lag_frac`` passed the threshold.
    """

    rank: int
    lag_s: float
    lag_frac: float
    data_wait_s: float
    flagged: bool

    def metrics(self) -> dict[str, float]:
        """The logged metrics: ``straggler_rank``, ``straggler_lag_s``, ``straggler_lag_frac`` and
        ``straggler_flagged`` (1.0 when the lag passed the threshold; the run summary counts those)."""
        return {
            "straggler_rank": float(self.rank),
            "straggler_lag_s": self.lag_s,
            "straggler_lag_frac": self.lag_frac,
            "straggler_flagged": float(self.flagged),
        }

    def describe(self) -> str:
        """One line for the log."""
        return (
            f"straggler: rank {self.rank} is {self.lag_s:.3f} s/step ({100 * self.lag_frac:.0f}%) slower than the "
            f"median rank (its data wait {self.data_wait_s:.3f} s/step)"
        )


def find_straggler(busy_s: list[float], data_wait_s: list[float], threshold: float) -> StragglerReport:
    """The rank with the most busy time per step (index = rank), its lag over the lower median.

    Args:
        busy_s: each rank's busy time per step.
        data_wait_s: each rank's data wait per step.
        threshold: the lag fraction over which the report is ``flagged``.
    """
    if not busy_s or len(busy_s) != len(data_wait_s):
        raise ValueError(f"find_straggler: {len(busy_s)} busy times for {len(data_wait_s)} data waits")
    rank = max(range(len(busy_s)), key=busy_s.__getitem__)
    median = statistics.median_low(busy_s)
    lag = busy_s[rank] - median
    frac = lag / median if median > 0 else 0.0
    return StragglerReport(rank, lag, frac, data_wait_s[rank], frac > threshold)


class StragglerMeter:
    """Measures this rank's host time per logging interval and finds the interval's straggler.

    The trainer reports data waits (:meth:`add_data_wait`) and waits in the step's host synchronisation
    (:meth:`add_sync_wait`), and calls :meth:`delay` at the start of each step and :meth:`gather` (a
    collective over ``group``) when it logs; the meter counts steps from the events.

    Args:
        group: the host (gloo) group over all ranks, or None: nothing is gathered.
        threshold: the lag fraction over which a straggler is warned about; None: off.
        rank: this rank (its ``PLAIT_DEBUG_RANK_DELAY`` delay is read here).
        is_main: whether this rank logs the warning.
        events: the bus whose :class:`TrainingStart` and :class:`StepEnd` it follows.
    """

    def __init__(
        self,
        group: Any,
        threshold: float | None,
        *,
        rank: int,
        is_main: bool,
        events: EventBus,
    ) -> None:
        self.group = group if threshold is not None and dist.is_initialized() else None
        self.threshold = threshold if threshold is not None else float("inf")
        self.is_main = is_main
        self.last: StragglerReport | None = None
        self._delay = rank_delay_from_env(rank)
        self._hang = rank_hang_from_env(rank)
        self._rank = rank
        self._step = 0
        self._reset()
        events.subscribe(TrainingStart, lambda e: self._reset())
        events.subscribe(StepStart, self._on_step_start)
        events.subscribe(StepEnd, self._on_step_end)

    def _reset(self) -> None:
        self._t0 = time.perf_counter()
        self._sync_wait = 0.0
        self._data_wait = 0.0
        self._steps = 0

    def _on_step_start(self, e: StepStart) -> None:
        self._step = e.step

    def _on_step_end(self, e: StepEnd) -> None:
        self._steps += 1

    def delay(self) -> None:
        """Sleep this rank's ``PLAIT_DEBUG_RANK_DELAY`` delay, or hang as ``PLAIT_DEBUG_RANK_HANG`` asks
        (test hooks; nothing without them)."""
        if self._delay:
            time.sleep(self._delay)
        if self._hang is not None and self._step == self._hang.step:
            how = "stopping (SIGSTOP)" if self._hang.stop else "hanging"
            os.write(2, f"[rank {self._rank}] {RANK_HANG_ENV}: {how} in step {self._step}\n".encode())
            if self._hang.stop:
                os.kill(os.getpid(), signal.SIGSTOP)
            while True:  # until the watchdog or the launcher ends the process
                time.sleep(3600)

    def add_data_wait(self, seconds: float) -> None:
        """Count time spent waiting for a batch."""
        self._data_wait += seconds

    def add_sync_wait(self, seconds: float) -> None:
        """Count time spent in the step's host synchronisation (waiting for the other ranks)."""
        self._sync_wait += seconds

    def gather(self) -> dict[str, float]:
        """Gather every rank's figures of the interval (a collective on the host group: every rank calls
        it), find the straggler, warn on the main rank when it is flagged, and start a new interval.

        Returns:
            The report's :meth:`~StragglerReport.metrics`; empty without a host group (one process,
            ``logging.straggler_threshold=None``).
        """
        if self.group is None:
            return {}
        # the step in progress (the one logging now) counts: it ran through its synchronisation
        steps = max(self._steps + 1, 1)
        wall = time.perf_counter() - self._t0
        mine = torch.tensor([(wall - self._sync_wait) / steps, self._data_wait / steps], dtype=torch.float64)
        rows = [torch.empty_like(mine) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(rows, mine, group=self.group)
        self._reset()
        self._steps = -1  # the step in progress was counted in this interval
        report = find_straggler([float(r[0]) for r in rows], [float(r[1]) for r in rows], self.threshold)
        self.last = report
        if report.flagged and self.is_main:
            logger.warning(report.describe())
        return report.metrics()
