"""Token <-> expert-order permutations with gather-only, deterministic backward passes.

A token routed to k experts appears as k *assignments* ``token * k + j``. Sorting the assignments by
expert (stably, so tokens keep their order inside an expert) gives ``perm``: sorted row -> assignment.
Dropped assignments carry the sentinel expert id ``E`` and sort last, so the kept rows are
``perm[:M]``. The autograd functions below gather in one direction and ``index_copy`` (a permutation:
no collisions, no atomics) in the other, and sum a token's k copies with a reshape, not ``index_add``.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from plait.kernels import RowIdMap, unpermute
from torch import Tensor


def sort_by_expert(topk_idx: Tensor, num_experts: int) -> tuple[Tensor, Tensor]:
    """Stable expert order of the assignments.

    Args:
        topk_idx: ``[T, k]`` expert ids; ``num_experts`` marks a dropped assignment.
        num_experts: E.

    Returns:
        ``perm`` ``[T*k]`` (sorted row -> assignment index, dropped ones last) and
        ``counts`` ``[E + 1]`` int64 (assignments per expert, last entry = dropped).
    """
    flat = topk_idx.reshape(-1)
    perm = torch.sort(flat, stable=True).indices
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int64))
    return perm, counts


def _scatter_rows(src: Tensor, index: Tensor, num_rows: int) -> Tensor:
    """``out[index[i]] = src[i]`` into ``num_rows`` rows (others zero)."""
    full = src.shape[0] == num_rows
    out = src.new_empty((num_rows, *src.shape[1:])) if full else src.new_zeros((num_rows, *src.shape[1:]))
    return out.index_copy_(0, index, src)


class _Dispatch(torch.autograd.Function):
    """``out[r] = x[perm[r] // k]``: copies each token once per kept assignment."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, perm: Tensor, top_k: int) -> Tensor:
        ctx.save_for_backward(perm)
        ctx.top_k = top_k
        ctx.num_tokens = x.shape[0]
        return x.index_select(0, perm // top_k)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        (perm,) = ctx.saved_tensors
        return _combine_impl(grad, perm, ctx.num_tokens, ctx.top_k), None, None


def _kernel_combine(y: Tensor) -> bool:
    """Use plait.kernels' Triton k-way gather-sum (CUDA, or the Triton interpreter in tests)."""
    return y.dim() == 2 and (y.is_cuda or os.environ.get("TRITON_INTERPRET", "0") == "1")


def _combine_impl(y: Tensor, perm: Tensor, num_tokens: int, top_k: int) -> Tensor:
    if _kernel_combine(y):
        # One pass: out[t] = sum_j y[dst[t, j]], no [T*k, H] intermediate. dst = -1 for dropped slots.
        n = num_tokens * top_k
        dst = torch.full((n,), -1, dtype=torch.int64, device=y.device)
        dst.index_copy_(0, perm, torch.arange(perm.shape[0], device=y.device))
        dst = dst.view(num_tokens, top_k)
        row_map = RowIdMap(src=perm // top_k, dst=dst, experts=dst)  # `experts` is unused without probs
        return unpermute(y, row_map, num_tokens)
    full = _scatter_rows(y, perm, num_tokens * top_k)
    if top_k == 1:
        return full
    return full.view(num_tokens, top_k, *y.shape[1:]).sum(dim=1)


class _Combine(torch.autograd.Function):
    """``out[t] = sum_j y[row of assignment t*k+j]`` (dropped assignments contribute zero)."""

    @staticmethod
    def forward(ctx: Any, y: Tensor, perm: Tensor, num_tokens: int, top_k: int) -> Tensor:
        ctx.save_for_backward(perm)
        ctx.top_k = top_k
        return _combine_impl(y, perm, num_tokens, top_k)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        (perm,) = ctx.saved_tensors
        return grad.index_select(0, perm // ctx.top_k), None, None, None


def dispatch_rows(x: Tensor, perm: Tensor, top_k: int = 1) -> Tensor:
    """Rows of ``x`` in expert order: ``x[perm // top_k]`` (differentiable, gather-only backward)."""
    return _Dispatch.apply(x, perm, top_k)  # type: ignore[no-any-return]


def combine_rows(y: Tensor, perm: Tensor, num_tokens: int, top_k: int = 1) -> Tensor:
    """Inverse of :func:`dispatch_rows`, summing each token's ``top_k`` rows."""
    return _Combine.apply(y, perm, num_tokens, top_k)  # type: ignore[no-any-return]
