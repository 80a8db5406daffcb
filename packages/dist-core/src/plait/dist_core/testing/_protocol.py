"""Messages exchanged between the harness and its rank processes (plain-pickled frozen dataclasses)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Task:
    """One rank's share of a :func:`run_distributed` call."""

    payload: bytes  # pickle of (fn, args, kwargs), unpickled in the worker so errors name the rank
    env: dict[str, str]  # RANK, WORLD_SIZE, LOCAL_RANK, ... as torchrun sets them
    sys_path: list[str]  # the caller's sys.path, so test modules import in the worker
    cwd: str
    backend: str
    timeout: float


@dataclass(frozen=True)
class TaskResult:
    """What a rank sends back: the pickled return value, or the formatted traceback."""

    ok: bool
    payload: bytes = b""
    error: str = ""
    during_setup: bool = False  # failed while joining the process group
