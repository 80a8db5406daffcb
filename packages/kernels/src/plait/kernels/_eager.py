"""Eager calls of a plait op without the custom-op dispatcher.

A call through ``torch.library.custom_op`` costs on the order of 100 us of host time (dispatcher,
schema checks, the registered autograd wrapper), and its backward op as much again: more than a
memory-bound kernel of a training step takes on the GPU. Eager calls therefore run the op's own
implementation and autograd formula through a plain ``torch.autograd.Function``; the custom ops
stay registered for ``torch.ops.plait`` users and for graphs that trace them.

Skipping the dispatcher also skips tensor subclasses' ``__torch_dispatch__``. The one a training
step hands these ops is the ``AsyncCollectiveTensor`` of a functional collective (the output of a
tensor-parallel all-reduce): it is waited for and unwrapped here, below autograd, which has already
recorded the wrapper as the input. Other subclasses reach the PyTorch formula
(:func:`plait.kernels._dispatch.use_triton`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed._functional_collectives import AsyncCollectiveTensor

__all__ = ["eager_autograd"]


def _waited(args: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(a.trigger_wait() if isinstance(a, AsyncCollectiveTensor) else a for a in args)


def eager_autograd(
    forward: Callable[..., Any],
    setup_context: Callable[[Any, tuple[Any, ...], Any], None],
    backward: Callable[..., tuple[Any, ...]],
    name: str = "_Eager",
) -> Callable[..., Any]:
    """``apply`` of an autograd function made of a custom op's parts.

    Args:
        forward: The op's implementation (what the custom op runs).
        setup_context: The op's ``setup_context(ctx, inputs, output)``.
        backward: Its autograd formula, calling the backward implementation directly.
        name: The function's class name (its autograd node is ``<name>Backward``).
    """

    def fwd(*args: Any) -> Any:
        return forward(*_waited(args))

    def setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        setup_context(ctx, _waited(inputs), output)

    def bwd(ctx: Any, *grads: Any) -> Any:
        return backward(ctx, *grads)

    parts = {
        "forward": staticmethod(fwd),
        "setup_context": staticmethod(setup),
        "backward": staticmethod(bwd),
    }
    return type(name, (torch.autograd.Function,), parts).apply  # type: ignore[attr-defined,no-any-return]
