"""Rank process of the distributed test harness (started by :mod:`plait.dist_core.testing._pool`).

A worker imports torch once, connects back to the harness, then loops: receive a task, set the
torchrun environment variables, initialise the default process group, run the function, tear the
group down and send back the result or the formatted traceback. It exits when the harness closes
the connection (so workers never outlive the test session).
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import runpy
import signal
import sys
import traceback
import types
from datetime import timedelta
from multiprocessing.connection import Client, Connection
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map

from plait.dist_core.testing._protocol import Task, TaskResult

_MAIN_MODULES: dict[str, types.ModuleType] = {}


def _load_parent_main(path: str) -> None:
    """Make the parent's ``__main__`` script importable so that functions defined in it unpickle."""
    module = _MAIN_MODULES.get(path)
    if module is None:
        # Same trick as multiprocessing's spawn: run the script under a name that skips its
        # ``if __name__ == "__main__":`` block.
        module = types.ModuleType("__mp_main__")
        module.__dict__.update(runpy.run_path(path, run_name="__mp_main__"))
        _MAIN_MODULES[path] = module
    sys.modules["__main__"] = sys.modules["__mp_main__"] = module


def _to_cpu(value: Any) -> Any:
    # Results travel by plain pickle; device tensors are moved so the harness needs no GPU.
    return tree_map(lambda x: x.cpu() if isinstance(x, torch.Tensor) and x.device.type != "cpu" else x, value)


def _run_task(task: Task) -> TaskResult:
    saved_env = dict(os.environ)
    saved_dtype = torch.get_default_dtype()
    try:
        os.environ.update(task.env)
        sys.path[:] = task.sys_path
        if task.cwd and os.path.isdir(task.cwd):
            os.chdir(task.cwd)
        if task.main_path is not None:
            _load_parent_main(task.main_path)
        fn, args, kwargs = pickle.loads(task.payload)
        if task.backend == "nccl" or "cuda" in task.backend:
            torch.cuda.set_device(int(task.env["LOCAL_RANK"]))
        dist.init_process_group(
            backend=task.backend,
            init_method="env://",
            rank=int(task.env["RANK"]),
            world_size=int(task.env["WORLD_SIZE"]),
            timeout=timedelta(seconds=task.timeout),
        )
        try:
            value = _to_cpu(fn(*args, **kwargs))
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        try:
            return TaskResult(ok=True, payload=pickle.dumps(value))
        except Exception:
            return TaskResult(ok=False, error="return value is not picklable:\n" + traceback.format_exc())
    except BaseException:
        return TaskResult(ok=False, error=traceback.format_exc())
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        torch.set_default_dtype(saved_dtype)
        sys.stdout.flush()
        sys.stderr.flush()


def main() -> None:
    """Connect to the harness and serve tasks until the connection closes."""
    if hasattr(signal, "SIGUSR1"):
        # The harness sends SIGUSR1 to a rank that hangs: all thread stacks go to the rank's log.
        faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    torch.set_num_threads(int(os.environ.get("PLAIT_HARNESS_THREADS", "1")))
    address = os.environ["PLAIT_HARNESS_ADDRESS"]
    authkey = bytes.fromhex(os.environ["PLAIT_HARNESS_AUTHKEY"])
    conn: Connection = Client(address, authkey=authkey)
    conn.send_bytes(pickle.dumps(os.getpid()))
    while True:
        try:
            message = conn.recv_bytes()
        except (EOFError, OSError):
            return
        task = pickle.loads(message)
        if task is None:
            return
        result = _run_task(task)
        try:
            conn.send_bytes(pickle.dumps(result))
        except (EOFError, OSError):
            return


if __name__ == "__main__":
    main()
