"""A warm pool of rank processes, kept alive across :func:`run_distributed` calls.

One pool per Python process. Workers are forked from a multiprocessing *forkserver* that preloads
torch and plait.dist_core once, so a new worker costs milliseconds instead of a torch import. The
pool grows to the largest world size asked for; a call with ``n`` ranks uses workers ``0..n-1``.
After a crash, a timeout, or a rank that stays stuck after another rank failed, the pool is killed
(its ranks may be blocked in collectives) and the next call forks a fresh one.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import os
import pickle
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.context import BaseContext
from typing import Any

from plait.dist_core.testing import _worker
from plait.dist_core.testing._protocol import Task, TaskResult
from plait.dist_core.testing.errors import DistributedTestError

# Seconds the other ranks get to finish after one rank failed, before they count as stuck.
_GRACE_AFTER_FAILURE = 3.0
_OUTPUT_TAIL = 6000


@dataclass
class _Worker:
    process: Any  # multiprocessing.Process of the pool's context
    conn: Connection
    log_path: str

    def alive(self) -> bool:
        return bool(self.process.is_alive())

    def log_size(self) -> int:
        try:
            return os.path.getsize(self.log_path)
        except OSError:
            return 0

    def output_since(self, offset: int) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(offset)
                text = f.read().decode(errors="replace")
        except OSError:
            return ""
        return text if len(text) <= _OUTPUT_TAIL else "...\n" + text[-_OUTPUT_TAIL:]


@dataclass
class _Outcome:
    """What the ranks of one call answered so far."""

    results: dict[int, TaskResult] = field(default_factory=dict)
    failures: dict[int, str] = field(default_factory=dict)
    setup_failures: set[int] = field(default_factory=set)
    timed_out: bool = False

    def answered(self, rank: int) -> bool:
        return rank in self.results or rank in self.failures


def _receive(conn: Any, rank: int, worker: _Worker, offset: int, outcome: _Outcome) -> bool:
    """Read one rank's answer into ``outcome``; return True when it is a failure."""
    try:
        result: TaskResult = pickle.loads(conn.recv_bytes())
    except (EOFError, OSError):
        worker.process.join(timeout=5.0)
        outcome.failures[rank] = (
            f"rank process died (exit code {worker.process.exitcode}); its output:\n"
            f"{worker.output_since(offset)}"
        )
        return True
    if result.ok:
        outcome.results[rank] = result
        return False
    outcome.failures[rank] = result.error
    if result.during_setup:
        outcome.setup_failures.add(rank)
    return True


class _SetupFailure(Exception):
    """The ranks failed to form the process group; the call is retried once."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _context() -> BaseContext:
    if "forkserver" in multiprocessing.get_all_start_methods():
        ctx = multiprocessing.get_context("forkserver")
        # Only effective before the forkserver starts; harmless (just slower) if it already runs.
        # pytest too when the caller runs under it: test modules import it in every rank.
        preload = [
            "torch",
            "torch.distributed",
            _worker.__name__,
            "plait.dist_core.parallelize",
            "plait.dist_core.grad_norm",
        ]
        ctx.set_forkserver_preload(preload + (["pytest"] if "pytest" in sys.modules else []))
        return ctx
    return multiprocessing.get_context("spawn")


class WorkerPool:
    """Rank processes that import torch once and then serve many distributed calls."""

    def __init__(self) -> None:
        self._workers: list[_Worker] = []
        self._ctx: BaseContext | None = None
        self._log_dir: str | None = None
        self._lock = threading.RLock()
        self._failure_deadline = 0.0
        self.num_threads = int(os.environ.get("PLAIT_HARNESS_THREADS", "1"))

    @property
    def size(self) -> int:
        """Number of live workers."""
        return len(self._workers)

    # -- lifecycle -------------------------------------------------------------------------------
    def _ensure(self, n: int) -> None:
        if any(not w.alive() for w in self._workers):
            self._kill()
        if self._ctx is None:
            self._ctx = _context()
        if self._log_dir is None:
            self._log_dir = tempfile.mkdtemp(prefix="plait-harness-")
        assert self._log_dir is not None
        for i in range(len(self._workers), n):
            parent_conn, child_conn = self._ctx.Pipe(duplex=True)
            log_path = os.path.join(self._log_dir, f"worker{i}-{time.monotonic_ns()}.log")
            process = self._ctx.Process(  # type: ignore[attr-defined]
                target=_worker.main,
                args=(child_conn, log_path, self.num_threads),
                name=f"plait-harness-{i}",
                daemon=True,
            )
            process.start()
            child_conn.close()
            self._workers.append(_Worker(process, parent_conn, log_path))

    def shutdown(self) -> None:
        """Stop every worker (politely, then by force) and forget them."""
        with self._lock:
            for w in self._workers:
                with contextlib.suppress(OSError):
                    w.conn.send_bytes(pickle.dumps(None))
            deadline = time.monotonic() + 2.0
            for w in self._workers:
                w.process.join(timeout=max(0.0, deadline - time.monotonic()))
                if w.alive():
                    w.process.kill()
                    w.process.join()
                w.conn.close()
            self._workers = []
            if self._log_dir is not None:
                shutil.rmtree(self._log_dir, ignore_errors=True)
                self._log_dir = None

    def _kill(self) -> None:
        for w in self._workers:
            if w.alive():
                w.process.kill()
        for w in self._workers:
            w.process.join()
            w.conn.close()
        self._workers = []

    # -- one call --------------------------------------------------------------------------------
    def run(self, payload: bytes, world_size: int, backend: str, timeout: float) -> list[Any]:
        """Send one task per rank to workers ``0..world_size-1`` and collect the results.

        A rendezvous failure (e.g. another process took the chosen port) is retried once with a
        fresh port; failures of ``fn`` itself are never retried.
        """
        try:
            return self._run_once(payload, world_size, backend, timeout)
        except _SetupFailure:
            return self._run_once(payload, world_size, backend, timeout, retry=False)

    def _run_once(
        self, payload: bytes, world_size: int, backend: str, timeout: float, retry: bool = True
    ) -> list[Any]:
        with self._lock:
            self._ensure(world_size)
            workers = self._workers[:world_size]
            port = _free_port()
            offsets = [w.log_size() for w in workers]
            for rank, w in enumerate(workers):
                env = {
                    "RANK": str(rank),
                    "WORLD_SIZE": str(world_size),
                    "LOCAL_RANK": str(rank),
                    "LOCAL_WORLD_SIZE": str(world_size),
                    "GROUP_RANK": "0",
                    "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port),
                }
                task = Task(payload, env, list(sys.path), os.getcwd(), backend, timeout)
                w.conn.send_bytes(pickle.dumps(task))
            return self._collect(workers, offsets, timeout, retry)

    def _collect(self, workers: list[_Worker], offsets: list[int], timeout: float, retry: bool) -> list[Any]:
        try:
            outcome = self._gather(workers, offsets, timeout)
        except BaseException:
            self._kill()
            raise
        stuck = [r for r in range(len(workers)) if r not in outcome.results and r not in outcome.failures]
        if retry and outcome.failures and set(outcome.failures) == outcome.setup_failures:
            if stuck or any(not w.alive() for w in workers):
                self._kill()
            raise _SetupFailure
        if stuck:
            self._raise_stuck(outcome, workers, offsets, stuck, timeout)
        if outcome.failures:
            if any(not w.alive() for w in workers):
                self._kill()
            raise DistributedTestError(
                _format_failures(outcome.failures, workers, offsets), failed_ranks=sorted(outcome.failures)
            )
        return [pickle.loads(outcome.results[r].payload) for r in range(len(workers))]

    def _gather(self, workers: list[_Worker], offsets: list[int], timeout: float) -> _Outcome:
        """Wait for every rank's answer, until the deadline (shortened to a grace period by a failure)."""
        outcome = _Outcome()
        rank_of = {id(w.conn): r for r, w in enumerate(workers)}
        deadline = time.monotonic() + timeout
        while len(outcome.results) + len(outcome.failures) < len(workers):
            waiting = [w.conn for r, w in enumerate(workers) if not outcome.answered(r)]
            if outcome.failures:
                deadline = min(deadline, self._failure_deadline)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                outcome.timed_out = not outcome.failures
                break
            for conn in wait(waiting, timeout=remaining):
                rank = rank_of[id(conn)]
                if _receive(conn, rank, workers[rank], offsets[rank], outcome) and len(outcome.failures) == 1:
                    self._failure_deadline = time.monotonic() + _GRACE_AFTER_FAILURE
        return outcome

    def _raise_stuck(
        self, outcome: _Outcome, workers: list[_Worker], offsets: list[int], stuck: list[int], timeout: float
    ) -> None:
        stacks = self._dump_stacks(workers, stuck, offsets)
        self._kill()
        if outcome.timed_out:
            raise DistributedTestError(
                f"timed out after {timeout:.1f}s; ranks {stuck} did not finish. Their stacks:\n{stacks}",
                failed_ranks=stuck,
            )
        raise DistributedTestError(
            _format_failures(outcome.failures, workers, offsets)
            + f"\n\nranks {stuck} did not finish within {_GRACE_AFTER_FAILURE:.0f}s after the failure "
            f"(probably waiting in a collective for the failed rank). Their stacks:\n{stacks}",
            failed_ranks=sorted(outcome.failures),
        )

    @staticmethod
    def _dump_stacks(workers: list[_Worker], ranks: list[int], offsets: list[int]) -> str:
        if not hasattr(signal, "SIGUSR1"):
            return "(stack dumps need SIGUSR1)"
        for r in ranks:
            if workers[r].alive():
                os.kill(workers[r].process.pid, signal.SIGUSR1)
        time.sleep(0.5)
        return "\n".join(f"--- rank {r} ---\n{workers[r].output_since(offsets[r])}" for r in ranks)


def _format_failures(failures: dict[int, str], workers: list[_Worker], offsets: list[int]) -> str:
    ranks = sorted(failures)
    parts = [f"{len(ranks)} of {len(workers)} ranks failed: rank{'s' if len(ranks) > 1 else ''} {ranks}"]
    for r in ranks:
        parts.append(f"\n--- rank {r} traceback ---\n{failures[r].rstrip()}")
        out = workers[r].output_since(offsets[r]).strip()
        if out:
            parts.append(f"--- rank {r} output ---\n{out}")
    return "\n".join(parts)


_POOL: WorkerPool | None = None


def get_pool() -> WorkerPool:
    """The process-wide pool, created on first use and shut down at interpreter exit."""
    global _POOL
    if _POOL is None:
        _POOL = WorkerPool()
        atexit.register(_POOL.shutdown)
    return _POOL
