"""The split-backward switch: which gradients plait's ops compute in their backward.

A pipeline schedule with split backward (zero-bubble style) first runs an *inputs* pass, which
only needs gradients w.r.t. the activations flowing back to the previous stage, and later a
*weights* pass. PyTorch's custom ``autograd.Function``s compute every gradient they are asked
for, whatever the pass (pytorch issue 174017). plait's ops (torch custom ops with registered
autograd) read :func:`current_grad_direction` in their backward and return ``None`` for the kind of
gradient that is switched off.

The switch is process-wide (not thread-local) on purpose: CUDA backward runs in autograd's
device threads, which would not see a thread-local or ``contextvars`` value set by the caller.

Under ``torch.compile`` a whole compiled region (a decoder layer) is one autograd node, so a
weights pass would have to carry activation gradients through the plait ops inside it to reach the
weights upstream of them. There the switch is read by plait's backward *ops* (torch custom ops,
opaque to the compiler) each time they run, and it switches off weight gradients only: an inputs
pass writes zeros for them, a weights pass computes everything inside the region. plait.pipelining's
split backward does not split such a region: its inputs pass is the region's whole backward, run
once under ``BOTH``.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["GradDirection", "current_grad_direction", "grad_direction"]


class GradDirection(enum.Flag):
    """Which gradients a backward pass computes.

    ``INPUTS``: gradients w.r.t. activations (what flows to earlier layers / stages).
    ``WEIGHTS``: gradients w.r.t. parameters (classifier, grouped-GEMM experts, norm weights).
    ``BOTH``: the normal backward.
    """

    INPUTS = enum.auto()
    WEIGHTS = enum.auto()
    BOTH = INPUTS | WEIGHTS


_lock = threading.Lock()
_stack: list[GradDirection] = []


def current_grad_direction() -> GradDirection:
    """Return the innermost active :class:`GradDirection` (``BOTH`` outside any context)."""
    return _stack[-1] if _stack else GradDirection.BOTH


@contextmanager
def grad_direction(direction: GradDirection) -> Iterator[GradDirection]:
    """Enable only the given gradients in plait autograd Functions for the duration of the block.

    Example:
        >>> with grad_direction(GradDirection.INPUTS):
        ...     torch.autograd.backward(outputs, grads, retain_graph=True)  # no weight grads
        >>> with grad_direction(GradDirection.WEIGHTS):
        ...     torch.autograd.backward(outputs, grads)  # weight grads only

    Args:
        direction: the gradients to compute; must not be empty.
    """
    if not isinstance(direction, GradDirection):
        raise TypeError(f"grad_direction expects a GradDirection, got {type(direction).__name__}")
    if not direction:
        raise ValueError("grad_direction: direction must enable INPUTS, WEIGHTS or both")
    with _lock:
        _stack.append(direction)
    try:
        yield direction
    finally:
        with _lock:
            _stack.pop()


def _weights_wanted(weights: bool) -> bool:
    """Whether a backward op computes the weight gradient it was asked for, read when it runs.

    Inside a compiled region only weight gradients can be skipped (an inputs pass); activation
    gradients may be needed by the ops upstream in the same region, so a weights pass keeps them.
    """
    return weights and GradDirection.WEIGHTS in current_grad_direction()


def _returned(inputs: bool, weights: bool) -> tuple[bool, bool]:
    """Which of (input, weight) gradients a plait backward function returns (the others are ``None``).

    Eager: the current direction decides, so a switched-off gradient is ``None`` and nothing is
    computed or accumulated for it. While torch.compile traces the backward: the needs unchanged,
    because the traced graph is fixed; its backward ops read the switch when they run
    (:func:`_weights_wanted`).
    """
    # is_compiling() covers AOTAutograd's trace of the backward only in newer torch; a TracingContext
    # is active during every torch.compile session (Dynamo through AOTAutograd), torch 2.11 included.
    if torch.compiler.is_compiling() or torch._guards.TracingContext.try_get() is not None:
        return inputs, weights
    d = current_grad_direction()
    return inputs and GradDirection.INPUTS in d, weights and GradDirection.WEIGHTS in d
