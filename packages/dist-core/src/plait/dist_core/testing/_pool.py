"""A warm pool of rank processes, kept alive across :func:`run_distributed` calls.

One pool per Python process. It grows to the largest world size asked for; a call with ``n`` ranks
uses workers ``0..n-1``. After a crash, a timeout or a rank that stays stuck after another rank
failed, the whole pool is killed (its ranks may be blocked in collectives) and the next call
starts a fresh one.
"""

from __future__ import annotations

import atexit
import json
import os
import pickle
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection, Listener, wait
from typing import IO, Any

from plait.dist_core.testing._protocol import Task, TaskResult
from plait.dist_core.testing.errors import DistributedTestError

# Seconds the other ranks get to finish after one rank failed, before they count as stuck.
_GRACE_AFTER_FAILURE = 3.0
_STARTUP_TIMEOUT = 120.0
_OUTPUT_TAIL = 6000

_BOOTSTRAP = (
    "import json, os, sys; sys.path[:] = json.loads(os.environ['PLAIT_HARNESS_SYS_PATH']); "
    "from plait.dist_core.testing._worker import main; main()"
)


@dataclass
class _Worker:
    process: subprocess.Popen[bytes]
    conn: Connection
    log_path: str
    log_file: IO[bytes]

    def alive(self) -> bool:
        return self.process.poll() is None

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


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class WorkerPool:
    """Rank processes that import torch once and then serve many distributed calls."""

    def __init__(self) -> None:
        self._workers: list[_Worker] = []
        self._authkey = secrets.token_bytes(16)
        self._listener: Listener | None = None
        self._log_dir: str | None = None
        self._lock = threading.Lock()

    # -- lifecycle -------------------------------------------------------------------------------
    def _ensure(self, n: int) -> None:
        dead = [w for w in self._workers if not w.alive()]
        if dead:
            self.shutdown()
        if len(self._workers) >= n:
            return
        if self._listener is None:
            self._listener = Listener(authkey=self._authkey)
            self._log_dir = tempfile.mkdtemp(prefix="plait-harness-")
        assert self._log_dir is not None
        env = dict(os.environ)
        env.update(
            PLAIT_HARNESS_ADDRESS=str(self._listener.address),
            PLAIT_HARNESS_AUTHKEY=self._authkey.hex(),
            PLAIT_HARNESS_SYS_PATH=json.dumps(sys.path),
            PYTHONUNBUFFERED="1",
        )
        # Ranks share few cores: one intra-op thread each unless the caller set it.
        env.setdefault("OMP_NUM_THREADS", "1")
        pending = []
        for i in range(len(self._workers), n):
            log_path = os.path.join(self._log_dir, f"worker{i}.log")
            log_file = open(log_path, "ab")  # noqa: SIM115 (lives as long as the worker)
            process = subprocess.Popen(
                [sys.executable, "-c", _BOOTSTRAP], env=env, stdout=log_file, stderr=subprocess.STDOUT
            )
            pending.append((process, log_path, log_file))
        # Workers connect in any order; match them to their process by the pid they send first.
        by_pid = {p.pid: (p, path, f) for p, path, f in pending}
        deadline = time.monotonic() + _STARTUP_TIMEOUT
        connected: dict[int, Connection] = {}
        while len(connected) < len(pending):
            conn = self._accept(deadline, pending)
            pid = pickle.loads(conn.recv_bytes())
            connected[pid] = conn
        for p, path, f in pending:
            self._workers.append(_Worker(p, connected[p.pid], path, f))
        del by_pid

    def _accept(self, deadline: float, pending: list[Any]) -> Connection:
        assert self._listener is not None
        # Listener.accept blocks without a timeout: poll the raw socket so a worker that dies at
        # start-up (bad environment) is reported instead of hanging.
        sock = self._listener._listener._socket  # type: ignore[attr-defined]
        sock.settimeout(1.0)
        while True:
            try:
                return self._listener.accept()
            except (TimeoutError, socket.timeout):
                for p, path, _ in pending:
                    if p.poll() is not None:
                        with open(path, "rb") as f:
                            out = f.read().decode(errors="replace")[-_OUTPUT_TAIL:]
                        self.shutdown()
                        raise DistributedTestError(
                            f"harness worker failed to start (exit code {p.returncode}):\n{out}"
                        ) from None
                if time.monotonic() > deadline:
                    self.shutdown()
                    raise DistributedTestError("harness workers did not start in time") from None

    def shutdown(self) -> None:
        """Stop every worker (politely, then by force) and forget them."""
        for w in self._workers:
            try:
                w.conn.send_bytes(pickle.dumps(None))
            except OSError:
                pass
        deadline = time.monotonic() + 2.0
        for w in self._workers:
            try:
                w.process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                w.process.kill()
                w.process.wait()
            w.conn.close()
            w.log_file.close()
        self._workers = []

    def _kill(self) -> None:
        for w in self._workers:
            if w.alive():
                w.process.kill()
        for w in self._workers:
            w.process.wait()
            w.conn.close()
            w.log_file.close()
        self._workers = []

    # -- one call --------------------------------------------------------------------------------
    def run(
        self,
        payload: bytes,
        world_size: int,
        backend: str,
        timeout: float,
        main_path: str | None,
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
                task = Task(payload, env, list(sys.path), os.getcwd(), main_path, backend, timeout)
                w.conn.send_bytes(pickle.dumps(task))
            return self._collect(workers, offsets, timeout)

    def _collect(self, workers: list[_Worker], offsets: list[int], timeout: float) -> list[Any]:
        results: dict[int, TaskResult] = {}
        failures: dict[int, str] = {}
        rank_of = {id(w.conn): r for r, w in enumerate(workers)}
        deadline = time.monotonic() + timeout
        timed_out = False
        try:
            while len(results) + len(failures) < len(workers):
                waiting = [w.conn for r, w in enumerate(workers) if r not in results and r not in failures]
                if failures:
                    deadline = min(deadline, self._failure_deadline)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    timed_out = not failures
                    break
                for conn in wait(waiting, timeout=remaining):
                    rank = rank_of[id(conn)]
                    try:
                        result: TaskResult = pickle.loads(conn.recv_bytes())  # type: ignore[union-attr]
                    except (EOFError, OSError):
                        w = workers[rank]
                        code = w.process.wait()
                        failures[rank] = (
                            f"rank process died (exit code {code}); its output:\n{w.output_since(offsets[rank])}"
                        )
                        self._failure_deadline = time.monotonic() + _GRACE_AFTER_FAILURE
                        continue
                    if result.ok:
                        results[rank] = result
                    else:
                        failures[rank] = result.error
                        if len(failures) == 1:
                            self._failure_deadline = time.monotonic() + _GRACE_AFTER_FAILURE
        except BaseException:
            self._kill()
            raise

        stuck = [r for r in range(len(workers)) if r not in results and r not in failures]
        if stuck:
            stacks = self._dump_stacks(workers, stuck, offsets)
            self._kill()
            if timed_out:
                raise DistributedTestError(
                    f"timed out after {timeout:.1f}s; ranks {stuck} did not finish. Their stacks:\n{stacks}",
                    failed_ranks=stuck,
                )
            raise DistributedTestError(
                _format_failures(failures, workers, offsets)
                + f"\n\nranks {stuck} did not finish within {_GRACE_AFTER_FAILURE:.0f}s after the failure "
                f"(probably waiting in a collective for the failed rank). Their stacks:\n{stacks}",
                failed_ranks=sorted(failures),
            )
        if failures:
            if any(not w.alive() for w in workers):
                self._kill()
            raise DistributedTestError(_format_failures(failures, workers, offsets), failed_ranks=sorted(failures))
        return [pickle.loads(results[r].payload) for r in range(len(workers))]

    _failure_deadline: float = 0.0

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
