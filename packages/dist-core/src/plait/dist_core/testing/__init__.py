"""Run a function on N rank processes with ``torch.distributed`` initialised: tests for parallel code.

Example:
    >>> import torch, torch.distributed as dist
    >>> from plait.dist_core.testing import run_distributed
    >>> def total(x):  # module-level, so it pickles by reference
    ...     t = torch.tensor([x + dist.get_rank()])
    ...     dist.all_reduce(t)
    ...     return t.item()
    >>> run_distributed(total, 4, 10)  # -> [46, 46, 46, 46]
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

from plait.dist_core.testing._pool import get_pool
from plait.dist_core.testing.errors import DistributedTestError

__all__ = ["DistributedTestError", "run_distributed", "shutdown_pool"]


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout: float = 120.0,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` rank processes and return each rank's result.

    The rank processes come from a warm pool kept alive across calls (each imports torch once), so
    a call costs the process-group set-up plus ``fn`` itself. In every rank, before ``fn`` runs,
    ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and
    ``MASTER_PORT`` are set as torchrun sets them (one node) and the default process group is
    initialised with ``backend``; it is destroyed afterwards, and environment variables and the
    default dtype are restored. With ``backend="nccl"`` each rank first calls
    ``torch.cuda.set_device(local_rank)``.

    Args:
        fn: a module-level function (pickled by reference: define it in a module or test file,
            not as a lambda or closure).
        world_size: number of ranks (>= 1).
        *args: positional arguments passed to ``fn`` on every rank (picklable).
        backend: ``torch.distributed`` backend, ``"gloo"`` (CPU) or ``"nccl"`` (one GPU per rank).
        timeout: seconds for the whole call; also the process group's collective timeout.
        **kwargs: keyword arguments passed to ``fn`` on every rank (picklable).

    Returns:
        ``fn``'s return values, index = rank (CUDA tensors are moved to CPU).

    Raises:
        DistributedTestError: a rank raised or crashed (message names the ranks, with tracebacks
            and output), or the call timed out (message holds the stuck ranks' stacks). Crashed or
            stuck pools are killed and replaced on the next call.
        ValueError: bad ``world_size``/``timeout``, or NCCL asked for without enough GPUs.
        TypeError: ``fn`` or the arguments cannot be pickled.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if timeout <= 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
    if backend == "nccl":
        import torch

        n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n_gpus < world_size:
            raise ValueError(
                f"backend='nccl' with world_size={world_size} needs {world_size} GPUs, found {n_gpus}"
            )
    try:
        payload = pickle.dumps((fn, args, kwargs))
    except Exception as e:
        raise TypeError(
            f"run_distributed could not pickle {getattr(fn, '__qualname__', fn)!r} and its arguments: {e}. "
            "Define fn at module level (not a lambda or a nested function) and pass picklable arguments."
        ) from e
    return get_pool().run(payload, world_size, backend, float(timeout))


def shutdown_pool() -> None:
    """Stop the warm rank processes now (they are also stopped at interpreter exit)."""
    get_pool().shutdown()
