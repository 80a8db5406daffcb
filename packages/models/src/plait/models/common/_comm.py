"""Tiny autograd helpers for tensor-parallel gradient reductions."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["all_reduce_backward"]


class _AllReduceBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def all_reduce_backward(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Identity forward; sums the gradient over ``group`` in backward (no-op if ``group`` is None).

    Used where each tensor-parallel rank sees only part of the consumers of a replicated tensor
    (head-sharded q/k norms, the vocab-sharded loss).
    """
    if group is None:
        return x
    return _AllReduceBackward.apply(x, group)
