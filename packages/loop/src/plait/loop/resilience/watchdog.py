"""The step watchdog: ends a rank whose training loop stops making progress, so the launcher restarts it.

A daemon thread compares the time spent in the current step (or checkpoint save, or evaluation) with
its limit. The trainer's events say when a step starts and ends and which phase it is in (``data``,
``forward_backward``, ``grad_clip``, ``optimizer``, ``metrics``: reading the step's statistics and
logging, where the host waits for the device; ``between_steps``); the trainer marks checkpoint saves
and evaluations with :meth:`StepWatchdog.phase`.

Limits (:class:`~plait.loop.config.sections.WatchdogConfig`): a step after the warm-up may take
``step_factor`` times the longest of the recent steps (at least ``min_step_s``); taking the longest
covers the steps in which the host waits for the device's queued work. The warm-up steps get
``warmup_step_s``; saves and evaluations ``checkpoint_s`` and ``evaluation_s``, their time left out of
the step's. Step limits are capped at 90% of the collective timeout in force, so the watchdog speaks
before a collective times out.

When a limit passes, the rank writes the step, the phase and the limit to stderr and the log, then, in
a process group of several ranks, what it waits for (:mod:`~plait.loop.resilience.diagnosis`): the ranks
that are stuck, read from the progress beacons every rank publishes in the default group's store, and
the torch.distributed collective its Python stack is in, with the collective's group, the group's ranks
and its caller::

    step watchdog: rank 1 made no progress for 10.0 s in step 7, phase 'data' (limit 10.0 s: ...); exiting ...
    step watchdog: rank 0 is stuck: last seen at step 6, phase 'optimizer', 10.0 s ago (frozen or dead);
        this rank (1) waits at step 7, phase 'data'
    step watchdog: rank 1 waits in all_reduce (torch/distributed/distributed_c10d.py:4181) over the default
        group (ranks [0, 1]), called from plait/loop/trainer.py:547 in _sum_over_dp

(one line each). Then come the Python stacks of all its threads (``faulthandler``), the NCCL flight
recorder when the default group is NCCL
(:func:`~plait.loop.resilience.flight_recorder.dump_nccl_flight_recorder`; it, not the Python stack, is the
authority on asynchronous collectives), a record ``<run_dir>/watchdog_rank<R>.json`` (rank, step, phase,
message, ``stuck_ranks``, ``collective``, unix time; removed when the rank's next ``fit()`` starts), and
the exit with :data:`WATCHDOG_EXIT_CODE` (75, ``EX_TEMPFAIL``) through
``os._exit``: no clean-up runs (a hung collective would block it). ``torchrun --max-restarts=N`` then
restarts the group, which resumes from the last complete checkpoint. torchrun itself exits 1 once its
restarts are spent, so a Slurm script that requeues after a hang looks for the record (a process
launched without torchrun exits 75 itself).

A restarted group must not meet the dead group's keys in the store it rendezvouses in. torchrun's
agent serves one store for all the restarts of its group and hands it to the workers
(``TORCHELASTIC_USE_AGENT_STORE=True``, the default of its ``static`` and ``c10d`` rendezvous): the
restarted ranks may then read the dead ranks' addresses and fail to create their process group (gloo
``connectFullMesh ... Connection refused``). :func:`restart_store_warning` says so when the job starts;
``--rdzv-backend c10d`` (or ``--standalone``) with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` in torchrun's
environment gives each restart a store of its own.
"""

from __future__ import annotations

import collections
import contextlib
import faulthandler
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch.distributed as dist
from plait.loop.config.sections import TimeoutConfig, WatchdogConfig
from plait.loop.events import (
    AfterForwardBackward,
    AfterOptimizerStep,
    BeforeForwardBackward,
    BeforeOptimizerStep,
    EventBus,
    StepEnd,
    StepStart,
)
from plait.loop.resilience.diagnosis import CollectiveWait, ProgressBeacon, collective_wait
from plait.loop.resilience.flight_recorder import dump_nccl_flight_recorder

__all__ = ["WATCHDOG_EXIT_CODE", "StepWatchdog", "restart_store_warning", "watchdog_enabled"]

WATCHDOG_EXIT_CODE = 75
"""The exit status of a rank the watchdog ended (``EX_TEMPFAIL`` of sysexits.h: try again)."""

# The step limits stay below this fraction of the collective timeout in force.
_COLLECTIVE_TIMEOUT_SHARE = 0.9
# Seconds the diagnostics may take before the process exits anyway (a hung log handler, a dump).
_DIAGNOSTICS_S = 30.0

logger = logging.getLogger("plait.loop")


def watchdog_enabled(config: WatchdogConfig, environ: Mapping[str, str] = os.environ) -> bool:
    """``timeouts.watchdog.enabled`` resolved: ``auto`` is on under torchrun (``TORCHELASTIC_RUN_ID`` set)."""
    if config.enabled == "auto":
        return "TORCHELASTIC_RUN_ID" in environ
    return bool(config.enabled)


def restart_store_warning(environ: Mapping[str, str] = os.environ) -> str | None:
    """A warning when torchrun may restart this job on several nodes in the store of the group it
    restarts, else None.

    torchrun (``--max-restarts`` > 0) restarts a failed group in the store its agent serves when it
    shares that store with the workers (``TORCHELASTIC_USE_AGENT_STORE=True``): the dead group's keys
    (each rank's address) are still there. On one node plait's process group keeps each attempt's keys
    apart (``DistributedContext.from_env``); across nodes the attempts' counts may differ, so the store
    itself must be new per attempt.
    """
    if environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or environ.get("GROUP_WORLD_SIZE", "1") == "1":
        return None
    try:
        restarts = int(environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    except ValueError:
        return None
    if restarts <= 0:
        return None
    return (
        f"torchrun may restart this job on several nodes ({restarts} restarts) in the store of the group it restarts "
        "(TORCHELASTIC_USE_AGENT_STORE=True): the restarted ranks may read the dead ranks' addresses and fail "
        "to create their process group (gloo: 'connectFullMesh ... Connection refused'). Launch torchrun with "
        "--rdzv-backend c10d (or --standalone) and TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment: "
        "each restart then gets a store of its own"
    )


class StepWatchdog:
    """Tracks the training loop's progress on this rank and ends the process when it stalls.

    Args:
        timeouts: the ``timeouts`` section (its ``watchdog`` limits; its collective timeouts cap them).
        events: the bus whose step events it follows.
        sync_every: the most steps the host may run ahead of the device (``logging.interval``: the
            trainer reads the step statistics at least that often); the warm-up lasts until that many
            steps were timed after ``warmup_steps``.
        rank: this rank (for the message and the flight recorder's file).
        run_dir: where the flight recorder's file goes.
        enabled: None resolves ``timeouts.watchdog.enabled`` (:func:`watchdog_enabled`); a disabled
            watchdog follows the events but starts no thread.
        on_expire: called with the message when a limit passes (default: diagnostics, then
            ``os._exit(WATCHDOG_EXIT_CODE)``); tests pass their own.
        clock: a monotonic clock (tests pass their own).
        poll_s: how often the thread looks (default: a tenth of the smallest limit, at most 1 s).
    """

    def __init__(
        self,
        timeouts: TimeoutConfig,
        events: EventBus,
        *,
        sync_every: int = 1,
        rank: int = 0,
        run_dir: Path | None = None,
        enabled: bool | None = None,
        on_expire: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        poll_s: float | None = None,
    ) -> None:
        self.config = timeouts.watchdog
        self.timeouts = timeouts
        self.enabled = watchdog_enabled(self.config) if enabled is None else enabled
        self.sync_every = max(1, sync_every)
        self.rank = rank
        self.run_dir = run_dir if run_dir is not None else Path.cwd()
        self._on_expire = on_expire or self._exit
        self._clock = clock
        cfg = self.config
        smallest = min(cfg.min_step_s, cfg.warmup_step_s, cfg.checkpoint_s, cfg.evaluation_s)
        self.poll_s = poll_s if poll_s is not None else min(1.0, smallest / 10)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._durations: collections.deque[float] = collections.deque(maxlen=max(16, 2 * self.sync_every))
        self._steps_seen = 0  # steps ended since start()
        self._step = 0
        self._phase = "idle"
        self._phase_t0 = 0.0  # when the current phase began
        self._started = 0.0  # when the current deadline's clock started
        self._step_t0 = 0.0
        self._excluded = 0.0  # seconds of the current step spent in checkpoint saves and evaluations
        self._watching = False  # between start() and stop()
        self._limit: float | None = None  # None: nothing is watched now
        self._why = ""
        self._warned = False
        self._beacon: ProgressBeacon | None = None  # this rank's progress for the others (several ranks)
        self.expired: str | None = None
        self.stuck_ranks: list[int] = []  # when expired: the ranks this one waits for
        self.collective: CollectiveWait | None = None  # when expired: the collective it waits in
        events.subscribe(StepStart, lambda e: self.step_started(e.step))
        events.subscribe(BeforeForwardBackward, lambda e: self.set_phase("forward_backward"))
        events.subscribe(AfterForwardBackward, lambda e: self.set_phase("grad_clip"))
        events.subscribe(BeforeOptimizerStep, lambda e: self.set_phase("optimizer"))
        events.subscribe(AfterOptimizerStep, lambda e: self.set_phase("metrics"))
        events.subscribe(StepEnd, lambda e: self.step_ended(e.step))

    @property
    def record_path(self) -> Path:
        """``<run_dir>/watchdog_rank<R>.json``: what the watchdog saw when it ended this rank."""
        return self.run_dir / f"watchdog_rank{self.rank}.json"

    # ------------------------------------------------------------------ the thread
    def start(self) -> None:
        """Start watching (a new warm-up: each fit() compiles and warms up again); no thread when disabled."""
        with self._lock:
            self._steps_seen = 0
            self._durations.clear()
            self._limit = None
            self._phase, self._phase_t0 = "idle", self._clock()
            self._watching = True
        if self.rank == 0 and not self._warned:
            self._warned = True
            warning = restart_store_warning()
            if warning is not None:
                logger.warning(warning)
        if not self.enabled or self._thread is not None:
            return
        with contextlib.suppress(OSError):  # a record of an earlier process of this rank
            self.record_path.unlink(missing_ok=True)
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="plait-step-watchdog", daemon=True)
        self._thread.start()
        self._beacon = ProgressBeacon.for_default_group(self._progress)
        if self._beacon is not None:
            self._beacon.start()

    def stop(self) -> None:
        """Stop watching and end the thread."""
        with self._lock:
            self._limit = None
            self._phase, self._phase_t0 = "idle", self._clock()
            self._watching = False
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._beacon is not None:
            self._beacon.stop()
            self._beacon = None

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            message = self.check()
            if message is not None:
                self.expired = message = self._explain(message)
                self._on_expire(message)
                return

    def _progress(self) -> tuple[int, str, float]:
        """The step, the phase and the unix time the phase began (what the beacon publishes)."""
        with self._lock:
            return self._step, self._phase, time.time() - (self._clock() - self._phase_t0)

    # ------------------------------------------------------------------ progress
    def step_limit(self) -> tuple[float, str]:
        """The limit of the next step (seconds) and how it was chosen."""
        cfg, timeouts = self.config, self.timeouts
        if self._steps_seen == 0:  # a fit()'s first step runs under the start-up collective timeout
            cap, cap_field = timeouts.init_s, "timeouts.init_s"
        else:
            cap, cap_field = timeouts.step_s, "timeouts.step_s"
        if self._steps_seen < cfg.warmup_steps or len(self._durations) < self.sync_every:
            limit, why = (
                cfg.warmup_step_s,
                f"a warm-up step: timeouts.watchdog.warmup_step_s={cfg.warmup_step_s:g}",
            )
        else:
            longest = max(self._durations)
            limit = max(cfg.min_step_s, cfg.step_factor * longest)
            why = (
                f"{cfg.step_factor:g}x the longest recent step {longest:.3g} s, at least "
                f"timeouts.watchdog.min_step_s={cfg.min_step_s:g}"
            )
        if limit > _COLLECTIVE_TIMEOUT_SHARE * cap:
            limit = _COLLECTIVE_TIMEOUT_SHARE * cap
            why = f"{_COLLECTIVE_TIMEOUT_SHARE:.0%} of {cap_field}={cap:g}"
        return limit, why

    def step_started(self, step: int) -> None:
        """A step begins (its batch is fetched next)."""
        with self._lock:
            now = self._clock()
            self._step, self._phase, self._phase_t0 = step, "data", now
            self._step_t0, self._started, self._excluded = now, now, 0.0
            if self._watching:
                self._limit, self._why = self.step_limit()

    def set_phase(self, name: str) -> None:
        """The step enters phase ``name`` (its limit runs on)."""
        with self._lock:
            self._phase, self._phase_t0 = name, self._clock()

    def step_ended(self, step: int) -> None:
        """A step is done (``step`` is the completed count); the time to the next step runs on its limit."""
        with self._lock:
            now = self._clock()
            if self._steps_seen >= self.config.warmup_steps:
                self._durations.append(now - self._step_t0 - self._excluded)
            self._steps_seen += 1
            self._step, self._phase, self._phase_t0 = step, "between_steps", now
            self._started = now
            if self._limit is not None:
                self._limit, self._why = self.step_limit()

    @contextlib.contextmanager
    def phase(self, name: str, step: int) -> Iterator[None]:
        """Watch a checkpoint save (``name="checkpoint"``) or an evaluation (``"evaluation"``) under its own
        limit; its time is left out of the step's. Outside :meth:`start`/:meth:`stop` it is not watched."""
        limit = self.config.checkpoint_s if name == "checkpoint" else self.config.evaluation_s
        with self._lock:
            saved = (self._step, self._phase, self._limit is not None)
            t0 = self._clock()
            self._step, self._phase, self._started, self._phase_t0 = step, name, t0, t0
            if saved[2]:
                self._limit, self._why = limit, f"timeouts.watchdog.{name}_s={limit:g}"
        try:
            yield
        finally:
            with self._lock:
                now = self._clock()
                self._excluded += now - t0
                self._step, self._phase = saved[0], saved[1]
                self._started = self._phase_t0 = now
                if saved[2] and self._limit is not None:
                    self._limit, self._why = self.step_limit()

    def check(self) -> str | None:
        """The message of a passed limit, or None while within it (what the thread calls every ``poll_s``)."""
        with self._lock:
            if self._limit is None:
                return None
            elapsed = self._clock() - self._started
            if elapsed <= self._limit:
                return None
            return (
                f"step watchdog: rank {self.rank} made no progress for {elapsed:.1f} s in step {self._step}, "
                f"phase {self._phase!r} (limit {self._limit:.1f} s: {self._why}); exiting with status "
                f"{WATCHDOG_EXIT_CODE} so that the launcher restarts the job"
            )

    def _explain(self, message: str) -> str:
        """``message`` with the ranks this one waits for and the collective it waits in, a line each (a
        process group of several ranks only; at most ``STORE_READ_S`` for the store; never raises)."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return message
        lines = [message]
        with contextlib.suppress(Exception):
            self.collective = collective_wait()
        name = self.collective.name if self.collective is not None else None
        if self._beacon is not None:
            with self._lock:
                step, phase = self._step, self._phase
            try:
                self.stuck_ranks, stuck = self._beacon.name_stuck(step, phase, name)
            except Exception as e:
                stuck = f"the other ranks' progress could not be read ({type(e).__name__}: {e})"
            lines.append(f"step watchdog: {stuck}")
        if self.collective is not None:
            wait = self.collective.describe(self.rank)
        else:
            wait = f"rank {self.rank} waits in no torch.distributed collective that its Python stacks show"
        with contextlib.suppress(Exception):
            if "nccl" in str(dist.get_backend()).lower():
                wait += (
                    " (NCCL runs collectives asynchronously: the NCCL flight recorder is the authority on "
                    "the collectives each rank started and completed)"
                )
        lines.append(f"step watchdog: {wait}")
        return "\n".join(lines)

    # ------------------------------------------------------------------ the exit
    def _exit(self, message: str) -> None:
        """Diagnostics (message, stacks, NCCL flight recorder), then ``os._exit(WATCHDOG_EXIT_CODE)``."""
        fallback = threading.Timer(_DIAGNOSTICS_S, os._exit, (WATCHDOG_EXIT_CODE,))
        fallback.daemon = True
        fallback.start()
        try:
            with contextlib.suppress(Exception):
                os.write(2, "".join(f"[rank {self.rank}] {line}\n" for line in message.splitlines()).encode())
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            record = {
                "rank": self.rank, "step": self._step, "phase": self._phase, "message": message,
                "stuck_ranks": self.stuck_ranks,
                "collective": self.collective.record() if self.collective is not None else None,
            }  # fmt: skip
            with contextlib.suppress(Exception):
                self.record_path.write_text(json.dumps({**record, "time": time.time()}))
            trace = dump_nccl_flight_recorder(self.run_dir, self.rank)
            if trace is not None:
                with contextlib.suppress(Exception):
                    os.write(2, f"[rank {self.rank}] NCCL flight recorder written to {trace}\n".encode())
            with contextlib.suppress(Exception):
                logger.critical(message)
                for handler in logging.getLogger("plait").handlers + logger.handlers:
                    handler.flush()
        finally:
            os._exit(WATCHDOG_EXIT_CODE)
