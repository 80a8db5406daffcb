"""When to run the Triton path: CUDA tensors, or any tensor under ``TRITON_INTERPRET=1``."""

from __future__ import annotations

import functools
import os

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor

__all__ = ["triton_available", "use_triton"]

_PLAIN = (torch.Tensor, torch.nn.Parameter)
_TRACED = (FakeTensor, FunctionalTensor)


@functools.cache
def triton_available() -> bool:
    """True when triton imports (it is a hard dependency on Linux, absent elsewhere)."""
    try:
        import triton
        import triton.language  # noqa: F401
    except Exception:
        return False
    return True


def _interpret() -> bool:
    # Read each call: tests flip it per process; triton itself reads it at kernel launch.
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _forced_off() -> bool:
    return os.environ.get("PLAIT_KERNELS_DISABLE_TRITON", "0") == "1"


def use_triton(*tensors: torch.Tensor) -> bool:
    """Whether the Triton kernels should run for these tensors.

    CUDA tensors use Triton; CPU tensors use it only under ``TRITON_INTERPRET=1`` (tests).
    ``PLAIT_KERNELS_DISABLE_TRITON=1`` forces the PyTorch reference path everywhere. Tensor
    subclasses (a DTensor, an ``AsyncCollectiveTensor`` whose collective may still be running)
    take the PyTorch path too: their ops dispatch through the subclass, a Triton kernel would
    read the wrapper's (absent) storage. The fake and functional tensors that ``torch.compile`` traces
    a ``torch.library.triton_op``'s body with take the Triton path on CUDA: that body launches its
    kernels through ``torch.library.wrap_triton``, which puts them into the compiled graph.
    """
    if _forced_off() or not triton_available():
        return False
    if any(isinstance(t, _TRACED) for t in tensors):
        return all(t.is_cuda for t in tensors)
    if any(type(t) not in _PLAIN for t in tensors):
        return False
    if all(t.is_cuda for t in tensors):
        return True
    return _interpret() and all(t.device.type == "cpu" for t in tensors)
