"""An exclusive lock on a run directory, so that two jobs never write into one run directory.

The lock is ``fcntl.flock`` on ``<run_dir>/plait.lock``, a file that holds the holder's pid, host and
start time. The kernel releases a flock when its holder dies (even by SIGKILL), so a lock left by a
dead process never blocks: the next run takes it over and reports whose it was. Only the job's main
rank takes it; the other ranks of the same job write into the same directory under its protection.

The lock belongs to the process: several trainers of one process on one run directory (a test that
trains, then resumes in the same process) share it, and it is released when the last of them
releases it or is garbage-collected.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import time
import weakref
from pathlib import Path
from typing import IO

__all__ = ["LOCK_NAME", "RunDirLease", "RunDirLockedError", "lock_run_dir"]

LOCK_NAME = "plait.lock"
log = logging.getLogger("plait.loop")

# The declared registry of this process's run-directory locks: resolved directory -> (file, holders).
_HELD: dict[Path, tuple[IO[str], int]] = {}
_OWNER: dict[Path, int] = {}  # the pid that took each of them


class RunDirLockedError(RuntimeError):
    """Another process holds the run directory's lock; the message names it (pid, host, start time)."""


class RunDirLease:
    """This holder's share of a run directory's lock; :meth:`release` (or garbage collection) ends it."""

    def __init__(self, key: Path) -> None:
        self.path = key / LOCK_NAME
        self._finalizer = weakref.finalize(self, _release, key)

    def release(self) -> None:
        """Give the share back (idempotent); the last share unlocks the directory."""
        self._finalizer()


def _describe(text: str) -> str:
    try:
        holder = json.loads(text)
        return f"pid {holder['pid']} on host {holder['host']} (started {holder['started']})"
    except (ValueError, KeyError, TypeError):
        return "another process"


def lock_run_dir(run_dir: str | Path) -> RunDirLease:
    """Take (or share, within this process) the exclusive lock of ``run_dir``, creating the directory.

    Raises:
        RunDirLockedError: another process holds it; the message names the holder and the lock file.
    """
    key = Path(run_dir).resolve()
    held = _HELD.get(key)
    if held is not None and _OWNER[key] == os.getpid():
        _HELD[key] = (held[0], held[1] + 1)
        return RunDirLease(key)
    key.mkdir(parents=True, exist_ok=True)
    path = key / LOCK_NAME
    f = open(path, "a+", encoding="utf-8")  # noqa: SIM115 - held open as long as the lock
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = _describe(f.read())
        f.close()
        raise RunDirLockedError(
            f"run directory {key} is in use by {holder} (lock file {path}); wait for that run to end "
            "or choose another run.run_dir"
        ) from None
    f.seek(0)
    previous = f.read().strip()
    if previous:
        log.warning(
            "run directory %s: taking over the lock of %s, which ended without releasing it",
            key,
            _describe(previous),
        )
    f.seek(0)
    f.truncate()
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    f.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": started}))
    f.flush()
    _HELD[key] = (f, 1)
    _OWNER[key] = os.getpid()
    return RunDirLease(key)


def _release(key: Path) -> None:
    if key not in _HELD or _OWNER.get(key) != os.getpid():
        return  # a forked child (a data-loader worker) must not unlock its parent's directory
    f, holders = _HELD[key]
    if holders > 1:
        _HELD[key] = (f, holders - 1)
        return
    del _HELD[key], _OWNER[key]
    # Emptied, not deleted: a process that opened the file just before a delete would lock a file
    # no longer in the directory, beside a new one that a third process locks.
    f.seek(0)
    f.truncate()
    f.flush()
    fcntl.flock(f, fcntl.LOCK_UN)
    f.close()
