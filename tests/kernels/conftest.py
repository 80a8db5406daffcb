"""Kernel test helpers.

The Triton path is tested on CPU under ``TRITON_INTERPRET=1``. Triton decides whether a kernel
(including its own ``tl.*`` helpers) is interpreted when the kernel is decorated, i.e. at import
time, so the interpreted checks run in one long-lived spawned worker process whose environment has
the variable set before ``import triton``. Test bodies are module-level ``check_*`` functions that
both paths call: directly (PyTorch path) or through the worker (Triton path).
"""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch


def _init_worker() -> None:
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def interpreter_pool() -> Iterator[Any]:
    pytest.importorskip("triton")
    ctx = mp.get_context("spawn")
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        pool = ctx.Pool(1, initializer=_init_worker)
    finally:
        if old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = old
    yield pool
    pool.terminate()
    pool.join()


class Runner:
    """Calls ``check_fn(*args)`` on one path; ``path`` is ``"torch"`` or ``"triton"``."""

    def __init__(self, path: str, pool: Any = None) -> None:
        self.path, self._pool = path, pool

    def __call__(self, fn: Callable[..., Any], *args: Any) -> Any:
        return fn(*args) if self._pool is None else self._pool.apply(fn, args)


@pytest.fixture(params=["torch", "triton"])
def run(request: pytest.FixtureRequest) -> Runner:
    """Runs a check on the PyTorch path, or in the interpreted-Triton worker process."""
    if request.param == "torch":
        return Runner("torch")
    return Runner("triton", request.getfixturevalue("interpreter_pool"))


def to64(*ts: torch.Tensor | None) -> list[Any]:
    return [None if t is None else t.detach().double().requires_grad_(t.requires_grad) for t in ts]


# Tolerances vs a float64 reference computed from the same (already rounded) inputs.
TOL = {torch.float32: {"atol": 1e-5, "rtol": 1e-4}, torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}}
