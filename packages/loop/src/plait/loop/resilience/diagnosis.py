"""What a stalled rank waits for: the ranks that are stuck, and the collective it waits in.

**Progress beacons.** While the step watchdog runs in a process group of several ranks, each rank
publishes its progress under ``plait/progress/<rank>`` in the store of the default process group (a
:class:`~torch.distributed.PrefixStore` inside it, so inside the prefix of the torchrun attempt too): its
step, phase, since when it is in that phase, the torch.distributed collective its main thread is in (if
any) and the time of publication. A thread of its own (``plait-progress-beacon``) writes the beacon, every
0.25 s when it changed and every second anyway; the training loop only updates the watchdog's fields, as
before (the thread's look at the main thread's stack takes ~10 us of the GIL per 0.25 s). A store write is a TCP round trip (~0.1 ms): six phase changes per step would cost the loop that
much on every step, and a store that stops answering (its server is in a frozen rank's process) would
block the loop or the watchdog; in a thread of its own it blocks nothing. The writer and the reader each
use a connection of their own (``Store.clone``): a store client serves one request at a time, and the
main thread may hold the shared one in a long ``wait``.

When the watchdog fires, it reads every rank's beacon (in a throw-away thread, for at most 2 s) and names
the ranks it waits for: a rank without a beacon, one out of its training loop, one whose beacon is older
than 5 s (frozen or dead: its beacon thread stopped too), one behind this rank (an earlier step or phase),
and one at this rank's phase but in no collective while this rank waits in one. When the store does not
answer and its server runs in rank 0's process (torchrun's agent does not serve it:
``TORCHELASTIC_USE_AGENT_STORE`` is not ``True``), rank 0 is named: its process is frozen or dead.

**The collective.** :func:`collective_wait` walks the Python stack of the main thread (then of the other
threads) from the innermost frame outward to the first frame of ``torch/distributed/`` whose function is a
collective (``all_reduce``, ``all_gather*``, ``reduce_scatter*``, ``broadcast``, ``barrier``,
``all_to_all*``, ``send``, ``recv``, ``wait*``, ...) and reports its name, its group (the frame's
``group``, ``pg`` or ``process_group`` local: None is the default group) with the group's ranks, and the
first frame outside torch that called it. With NCCL a collective is often queued asynchronously and waited
for elsewhere: the NCCL flight recorder, which the watchdog dumps too, is the authority there.

Nothing here raises into the watchdog: a failed look is reported as such, and the exit goes on.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from types import FrameType
from typing import Any

import torch.distributed as dist
from plait.loop.resilience.flight_recorder import default_store

__all__ = [
    "Beacon",
    "CollectiveWait",
    "ProgressBeacon",
    "collective_wait",
    "find_collective",
    "name_stuck_ranks",
]

BEACON_PREFIX = "plait/progress"
STALE_S = 5.0
"""A beacon older than this (seconds) belongs to a frozen or dead process (it is rewritten every second)."""
STORE_READ_S = 2.0
"""The longest the watchdog waits for the store when it reads the beacons (seconds)."""

# the order of the phases within a step (see StepWatchdog): an evaluation runs under the next step's
# number before the step ends; a checkpoint after the step ended, before the next one starts
_PHASE_ORDER = {
    "evaluation": 0,
    "between_steps": 1,
    "checkpoint": 2,
    "data": 3,
    "forward_backward": 4,
    "grad_clip": 5,
    "optimizer": 6,
    "metrics": 7,
}
_NAMED_AT_MOST = 8  # stuck ranks named one by one; the others are counted

_COLLECTIVE = re.compile(
    r"(?:^|_)(?:all_?reduce|all_?gather|reduce_scatter|broadcast|barrier|all_?to_?all|i?send|i?recv"
    r"|gather|scatter|reduce|wait)(?:_|$)"
)
_GROUP_LOCALS = ("group", "pg", "process_group")


# ---------------------------------------------------------------------------------------- the collective
@dataclass(frozen=True)
class CollectiveWait:
    """The torch.distributed collective a thread waits in.

    Attributes:
        name: its function, e.g. ``all_reduce``.
        where: its frame, ``torch/distributed/distributed_c10d.py:4150``.
        caller: the first frame outside torch that called it, ``plait/loop/trainer.py:547 in _sum_over_dp``.
        thread: the waiting thread's name.
        group: ``the default group``, ``group '<name>'``, or None when the frame names none.
        ranks: the group's global ranks (None when unknown).
    """

    name: str
    where: str
    caller: str | None
    thread: str
    group: str | None
    ranks: list[int] | None

    def describe(self, rank: int) -> str:
        """``rank 1 waits in all_reduce (torch/...:4150) over the default group (ranks [0, 1]), called from ...``."""
        who = f"rank {rank}" if self.thread == "MainThread" else f"rank {rank}'s thread {self.thread!r}"
        group = self.group or "a group it does not name"
        ranks = f" (ranks {self.ranks})" if self.ranks is not None else ""
        caller = f", called from {self.caller}" if self.caller else ""
        return f"{who} waits in {self.name} ({self.where}) over {group}{ranks}{caller}"

    def record(self) -> dict[str, Any]:
        """Its fields, for the watchdog's JSON record."""
        return asdict(self)


def _path(frame: FrameType) -> str:
    return frame.f_code.co_filename.replace(os.sep, "/")


def _short(path: str) -> str:
    """``torch/...`` or ``plait/...`` from a site or source path, else the path relative to the working directory."""
    for marker in ("/torch/", "/plait/"):
        i = path.rfind(marker)
        if i >= 0:
            return path[i + 1 :]
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return path
    return path if rel.startswith("..") else rel


def _describe_group(group: Any) -> tuple[str, list[int] | None]:
    """A group's label and global ranks (None when they cannot be read)."""
    initialized = dist.is_available() and dist.is_initialized()
    if group is None or (initialized and group is dist.group.WORLD):
        return "the default group", list(range(dist.get_world_size())) if initialized else None
    try:
        desc, name = getattr(group, "group_desc", None), getattr(group, "group_name", None)
    except Exception:
        desc = name = None
    label = desc if desc and desc != "undefined" else name
    try:
        ranks: list[int] | None = list(dist.get_process_group_ranks(group))
    except Exception:
        ranks = None
    return (f"group {label!r}" if label else f"group {type(group).__name__}"), ranks


def find_collective(
    frame: FrameType | None, thread: str = "MainThread", *, with_group: bool = True
) -> CollectiveWait | None:
    """The innermost torch.distributed collective on the stack that ends in ``frame`` (the innermost frame),
    or None.

    Args:
        frame: a thread's current frame (``sys._current_frames()[ident]``).
        thread: the thread's name, for the report.
        with_group: read the frame's group from its locals (the beacons leave it: a name is enough there).
    """
    f = frame
    while f is not None:
        path = _path(f)
        if "/torch/distributed/" in path and "/elastic/" not in path and _COLLECTIVE.search(f.f_code.co_name):
            caller = f.f_back
            while caller is not None and "/torch/" in _path(caller):
                caller = caller.f_back
            group: str | None = None
            ranks: list[int] | None = None
            if with_group:
                local_vars = f.f_locals
                for name in _GROUP_LOCALS:
                    if name in local_vars:
                        group, ranks = _describe_group(local_vars[name])
                        break
            return CollectiveWait(
                name=f.f_code.co_name,
                where=f"{_short(path)}:{f.f_lineno}",
                caller=(
                    f"{_short(_path(caller))}:{caller.f_lineno} in {caller.f_code.co_name}"
                    if caller is not None
                    else None
                ),
                thread=thread,
                group=group,
                ranks=ranks,
            )
        f = f.f_back
    return None


def collective_wait() -> CollectiveWait | None:
    """The collective the main thread waits in, else the first one another thread (not this one) waits in."""
    frames = sys._current_frames()  # noqa: SLF001 (the documented way to read other threads' stacks)
    main, me = threading.main_thread().ident, threading.get_ident()
    names = {t.ident: t.name for t in threading.enumerate()}
    for ident in sorted(frames, key=lambda i: i != main):
        if ident == me:
            continue
        found = find_collective(frames[ident], names.get(ident, str(ident)))
        if found is not None:
            return found
    return None


def _main_thread_collective() -> str | None:
    """The name of the collective the main thread is in, or None (no locals read: cheap and safe)."""
    frame = sys._current_frames().get(threading.main_thread().ident or 0)  # noqa: SLF001
    found = find_collective(frame, with_group=False)
    return found.name if found is not None else None


# ---------------------------------------------------------------------------------------- beacons
@dataclass(frozen=True)
class Beacon:
    """One rank's published progress: step, phase, since when (unix time), the collective its main thread
    is in (None: none), and when it was published (unix time)."""

    step: int
    phase: str
    since: float
    collective: str | None
    time: float

    def encode(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def decode(cls, raw: bytes) -> Beacon:
        d = json.loads(raw)
        return cls(int(d["step"]), str(d["phase"]), float(d["since"]), d.get("collective"), float(d["time"]))


Progress = Callable[[], tuple[int, str, float]]
"""Returns this rank's step, phase, and the unix time the phase began."""


class ProgressBeacon:
    """Publishes this rank's progress into a store from a thread of its own; reads every rank's.

    Args:
        store: the store shared by the ranks (the beacons go under ``plait/progress/``).
        rank: this rank.
        world_size: the number of ranks.
        progress: returns the step, the phase and the phase's start (unix time).
        poll_s: how often the thread looks for a change.
        refresh_s: the longest time between two writes (the beacon's age says the process is alive).
    """

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        world_size: int,
        progress: Progress,
        *,
        poll_s: float = 0.25,
        refresh_s: float = 1.0,
    ) -> None:
        self.store = dist.PrefixStore(BEACON_PREFIX, _own_connection(store))  # the beacon thread's
        self._reader = dist.PrefixStore(BEACON_PREFIX, _own_connection(store))  # the watchdog's read
        self.rank, self.world_size = rank, world_size
        self.poll_s, self.refresh_s = poll_s, refresh_s
        self._progress = progress
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def for_default_group(cls, progress: Progress) -> ProgressBeacon | None:
        """A beacon in the default process group's store; None for a single process (nothing to name)."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return None
        store = default_store()
        return None if store is None else cls(store, dist.get_rank(), dist.get_world_size(), progress)

    def start(self) -> None:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="plait-progress-beacon", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = STORE_READ_S) -> None:
        """Publish a last time (the watchdog's phase is ``idle`` then) and end the thread (waiting at most
        ``timeout`` for a store that does not answer)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def _run(self) -> None:
        last: tuple[int, str, str | None] | None = None
        written = 0.0
        while True:
            stopping = self._stop.is_set()
            try:
                step, phase, since = self._progress()
                state = (step, phase, _main_thread_collective())
                now = time.time()
                if state != last or now - written >= self.refresh_s or stopping:
                    self.store.set(str(self.rank), Beacon(step, phase, since, state[2], now).encode())
                    last, written = state, now
            except Exception:  # a store that went away (the job ends): the watchdog says what it can
                return
            if stopping:
                return
            self._stop.wait(self.poll_s)

    def read(self, timeout: float = STORE_READ_S) -> tuple[dict[int, Beacon] | None, str]:
        """Every rank's beacon (a rank that published none is missing), read in a throw-away thread.

        Returns:
            ``(beacons, "")``, or ``(None, why)`` when the store did not answer within ``timeout`` or failed.
        """
        keys = [str(r) for r in range(self.world_size)]
        found: dict[int, Beacon] = {}
        problem: list[str] = []
        done = threading.Event()

        def read_all() -> None:
            try:
                store = self._reader
                if store.check(keys):
                    values = dict(enumerate(store.multi_get(keys)))
                else:  # get() waits for a missing key: only those that are there
                    values = {r: store.get(k) for r, k in enumerate(keys) if store.check([k])}
                for r, raw in values.items():
                    with contextlib.suppress(ValueError, KeyError, TypeError):
                        found[r] = Beacon.decode(raw)
            except Exception as e:
                problem.append(f"failed ({type(e).__name__}: {e})")
            done.set()

        threading.Thread(target=read_all, name="plait-progress-read", daemon=True).start()
        if not done.wait(timeout):
            return None, f"did not answer within {timeout:g} s"
        return (None, problem[0]) if problem else (dict(found), "")

    def name_stuck(self, step: int, phase: str, collective: str | None) -> tuple[list[int], str]:
        """Read the beacons and name the ranks this one waits for (:func:`name_stuck_ranks`)."""
        beacons, problem = self.read()
        return name_stuck_ranks(
            beacons, rank=self.rank, world_size=self.world_size, step=step, phase=phase,
            collective=collective, now=time.time(), store_problem=problem, store_host=store_host_rank(),
        )  # fmt: skip


def _own_connection(store: dist.Store) -> dist.Store:
    """A client of ``store`` with a connection of its own (the store itself when it cannot clone)."""
    try:
        return store.clone()
    except Exception:  # a store without clone(): shared, one request at a time
        return store


def store_host_rank(environ: Mapping[str, str] = os.environ) -> int | None:
    """The rank whose process serves the default group's store: 0 (env:// and tcp:// rendezvous), or None
    when torchrun's agent serves it (``TORCHELASTIC_USE_AGENT_STORE=True``)."""
    return None if environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" else 0


def _progress_key(step: int, phase: str) -> tuple[int, int]:
    return step, _PHASE_ORDER.get(phase, _PHASE_ORDER["data"])


def name_stuck_ranks(
    beacons: Mapping[int, Beacon] | None,
    *,
    rank: int,
    world_size: int,
    step: int,
    phase: str,
    collective: str | None,
    now: float,
    store_problem: str = "",
    store_host: int | None = None,
    stale_s: float = STALE_S,
) -> tuple[list[int], str]:
    """The ranks this one waits for, and a sentence naming them.

    Args:
        beacons: every rank's beacon (a rank without one is missing); None: the store did not answer.
        rank: this rank.
        world_size: the number of ranks.
        step: this rank's step.
        phase: this rank's phase.
        collective: the collective this rank waits in, if any.
        now: the unix time.
        store_problem: what went wrong with the store (when ``beacons`` is None).
        store_host: the rank whose process serves the store (None: another process serves it).
        stale_s: a beacon older than this belongs to a frozen or dead process.
    """
    here = f"this rank ({rank}) waits at step {step}, phase {phase!r}"
    if beacons is None:
        if store_host is not None and store_host != rank:
            why = f"the store its process serves {store_problem} (frozen or dead)"
            return [store_host], f"rank {store_host} is stuck: {why}; {here}"
        return [], f"the other ranks' progress is unknown: the store {store_problem}; {here}"
    mine = _progress_key(step, phase)
    stuck: list[tuple[int, str]] = []
    for r in range(world_size):
        if r == rank:
            continue
        b = beacons.get(r)
        if b is None:
            why = "it published no progress"
        elif b.phase == "idle":
            why = f"out of its training loop (step {b.step}) for {max(0.0, now - b.since):.1f} s"
        elif now - b.time > stale_s:
            inside = f" in {b.collective}" if b.collective else ""
            why = f"last seen at step {b.step}, phase {b.phase!r}{inside}, {now - b.time:.1f} s ago (frozen or dead)"
        elif _progress_key(b.step, b.phase) < mine:
            why = f"at step {b.step}, phase {b.phase!r} for {max(0.0, now - b.since):.1f} s, behind this rank"
        elif collective is not None and b.collective is None and _progress_key(b.step, b.phase) == mine:
            why = (
                f"at step {b.step}, phase {b.phase!r} for {max(0.0, now - b.since):.1f} s, in no collective "
                f"while this rank waits in {collective}"
            )
        else:
            continue
        stuck.append((r, why))
    if not stuck:
        return [], f"no other rank is behind this one or silent; {here}"
    named = [f"rank {r} is stuck: {why}" for r, why in stuck[:_NAMED_AT_MOST]]
    if len(stuck) > _NAMED_AT_MOST:
        named.append(f"{len(stuck) - _NAMED_AT_MOST} more ranks are stuck")
    return [r for r, _ in stuck], "; ".join([*named, here])
