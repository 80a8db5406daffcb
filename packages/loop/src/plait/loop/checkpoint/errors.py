"""The errors of plait's checkpointing, and the one-line reason of a failed write."""

from __future__ import annotations

import errno
import os
from pathlib import Path

from torch.distributed.checkpoint.api import CheckpointException

__all__ = [
    "CheckpointDamagedError",
    "CheckpointMismatchError",
    "CheckpointWriteError",
    "UnsafeCheckpointError",
    "failure_reason",
]


class CheckpointMismatchError(RuntimeError):
    """The checkpoint on disk does not fit the state it is loaded into; the message lists what differs."""


class CheckpointWriteError(OSError):
    """A save failed while writing (a full disk, a lost mount): the message names the checkpoint, its
    directory, the reason (e.g. ``No space left on device``) and the newest complete checkpoint kept."""


class CheckpointDamagedError(RuntimeError):
    """A checkpoint's files are missing, truncated or corrupt, or hold data plait will not load;
    the message names the checkpoint and the file."""


class UnsafeCheckpointError(CheckpointDamagedError, ValueError):
    """A checkpoint's DCP ``.metadata`` pickle names a class or function that DCP metadata is not made
    of (a planted or foreign file); refused before anything of it runs. The message names the file and
    the refused ``module.name``. Resume treats it like any damaged checkpoint (falls back or stops)."""


def failure_reason(error: BaseException, root: Path) -> str:
    """One line for why a save failed: the first OSError of DCP's per-rank failures or the exception
    chain, else the exception's last line; a full file system is said as such even when torch's
    serializer reports it as an ``unexpected pos`` RuntimeError."""
    seen: list[BaseException] = []
    todo = [error]
    while todo:
        e = todo.pop()
        if e in seen:
            continue
        seen.append(e)
        if isinstance(e, CheckpointException):
            todo.extend(exc for exc, _ in e.failures.values() if isinstance(exc, BaseException))
        todo.extend(x for x in (e.__cause__, e.__context__) if x is not None)
    for e in seen:
        if isinstance(e, OSError) and not isinstance(e, CheckpointWriteError) and e.strerror:
            return e.strerror + (f" ({e.filename})" if e.filename else "")
    try:
        stat = os.statvfs(root)
        full = stat.f_bavail * stat.f_frsize < (1 << 20)
    except OSError:
        full = False
    if full:
        return os.strerror(errno.ENOSPC) + f" (less than 1 MiB free on the file system of {root})"
    last = seen[-1] if seen else error
    lines = str(last).strip().splitlines()
    return f"{type(last).__name__}: {lines[-1] if lines else ''}"
