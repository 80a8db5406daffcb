"""Eager calls of a plait op without the custom-op dispatcher.

A call through ``torch.library.custom_op`` costs on the order of 100 us of host time (dispatcher,
schema checks, the registered autograd wrapper), and its backward op as much again: more than a
memory-bound kernel of a training step takes on the GPU. Eager calls therefore run the op's own
implementation and autograd formula through a plain ``torch.autograd.Function``; the custom ops
stay registered for ``torch.ops.plait`` users and for graphs that trace them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["eager_autograd"]


def eager_autograd(
    forward: Callable[..., Any],
    setup_context: Callable[[Any, tuple[Any, ...], Any], None],
    backward: Callable[..., tuple[Any, ...]],
) -> Callable[..., Any]:
    """``apply`` of an autograd function made of a custom op's parts.

    Args:
        forward: The op's implementation (what the custom op runs).
        setup_context: The op's ``setup_context(ctx, inputs, output)``.
        backward: Its autograd formula, calling the backward implementation directly.
    """

    class _Eager(torch.autograd.Function):
        @staticmethod
        def forward(*args: Any) -> Any:
            return forward(*args)

        @staticmethod
        def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
            setup_context(ctx, inputs, output)

        @staticmethod
        def backward(ctx: Any, *grads: Any) -> Any:
            return backward(ctx, *grads)

    return _Eager.apply
