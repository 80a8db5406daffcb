"""Rank process of the distributed test harness (started by :mod:`plait.dist_core.testing._pool`).

Workers are forked from a multiprocessing forkserver that has already imported this module (and so
torch), so starting one costs milliseconds. A worker loops: receive a task, set the torchrun
environment variables, initialise the default process group, run the function, tear the group down
and send back the result or the formatted traceback. It exits when the harness closes the
connection (so workers never outlive the test session).
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import signal
import sys
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist
from plait.dist_core.context import release_cuda_graphs
from plait.dist_core.testing._protocol import Task, TaskResult
from torch.utils._pytree import tree_map


def _to_cpu(value: Any) -> Any:
    # Results travel by plain pickle; device tensors are moved so the harness needs no GPU.
    return tree_map(lambda x: x.cpu() if isinstance(x, torch.Tensor) and x.device.type != "cpu" else x, value)


def _run_task(task: Task) -> TaskResult:
    saved_env = dict(os.environ)
    saved_dtype = torch.get_default_dtype()
    setup = False
    try:
        os.environ.update(task.env)
        sys.path[:] = task.sys_path
        if task.cwd and os.path.isdir(task.cwd):
            os.chdir(task.cwd)
        fn, args, kwargs = pickle.loads(task.payload)
        setup = True
        if task.backend == "nccl" or "cuda" in task.backend:
            torch.cuda.set_device(int(task.env["LOCAL_RANK"]))
        timeout = timedelta(seconds=task.timeout)
        dist.init_process_group(
            backend=task.backend,
            init_method="env://",
            rank=int(task.env["RANK"]),
            world_size=int(task.env["WORLD_SIZE"]),
            timeout=timeout,
        )
        setup = False
        try:
            value = _to_cpu(fn(*args, **kwargs))
        finally:
            if dist.is_initialized():
                release_cuda_graphs()
                dist.destroy_process_group()
            _forget_meshes()
        try:
            return TaskResult(ok=True, payload=pickle.dumps(value))
        except Exception:
            return TaskResult(ok=False, error="return value is not picklable:\n" + traceback.format_exc())
    except BaseException:
        return TaskResult(ok=False, error=traceback.format_exc(), during_setup=setup)
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        torch.set_default_dtype(saved_dtype)
        sys.stdout.flush()
        sys.stderr.flush()


def _forget_meshes() -> None:
    """Drop DTensor's caches of sharding decisions, redistribution plans and mesh topologies.

    Their keys compare device meshes by shape and dim names, not by process group: a later task's mesh
    of the same shape would otherwise get a cached plan holding the previous task's mesh, whose groups
    are destroyed ("Could not resolve the process group registered under the name N"; seen running
    DeepSeek-V3's tp=2 x cp=2 test, then Llama's tp=2 x FSDP2 test, on the same 4 pooled ranks).
    """
    from torch.distributed.tensor import DTensor, _collective_utils, _redistribute

    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()  # noqa: SLF001 (no public API)
    clear_native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)  # noqa: SLF001
    if clear_native is not None:  # the C++ dispatch's own cache (recent torch)
        clear_native()
    _redistribute.clear_redistribute_planner_cache()
    _redistribute._gen_transform_infos.cache_clear()  # noqa: SLF001 (its docstring says to clear it so)
    _collective_utils.MeshTopoInfo.build_from_mesh.cache_clear()


def main(conn: Connection, log_path: str, num_threads: int) -> None:
    """Serve tasks from ``conn`` until it closes; stdout and stderr go to ``log_path``."""
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    if hasattr(signal, "SIGUSR1"):
        # The harness sends SIGUSR1 to a rank that hangs: all thread stacks go to the rank's log.
        faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    torch.set_num_threads(num_threads)
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
