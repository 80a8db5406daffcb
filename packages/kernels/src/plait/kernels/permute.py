"""MoE token permutation: expert-contiguous permute and weighted unpermute, without a host sync.

``permute`` lays the routed copies of the tokens (``topk_idx [T, k]``) out expert by expert (expert
0's copies first), stable in token order inside each expert, each expert's group zero-padded to a
multiple of ``align`` (grouped-GEMM kernels like 8/16/128-row aligned groups). Choices outside
``[0, num_experts)`` (the dropped-slot sentinel of capacity limits, or another rank's experts) are
skipped. The output has a size known from the shapes alone, ``T * k + E * (align - 1)`` rows: the
groups come first, the rows after them are not written (unspecified; the PyTorch path zeroes
them), and their count is known on the device (``RowIdMap.rows``): the kernels that follow skip
them. So nothing is read on the host and ``torch.compile`` sees static shapes. ``unpermute`` sums each token's copies back, optionally
weighted by the routing probabilities.

``max_rows`` caps the buffer below that bound (a caller that knows its groups are usually much
smaller, e.g. an expert-parallel rank that sees every rank's tokens but computes only its own
experts). The copies that would land past the cap are not written (their ``dst`` is ``-1``); the
returned group sizes are still the full ones, so ``tokens_per_expert.sum() > max_rows`` tells the
caller, on the device, that the buffer overflowed.

Index bookkeeping is PyTorch (a stable sort, scatters, cumsums). The row movement is the torch
ops ``plait::permute_rows`` / ``plait::unpermute_rows`` (Triton on CUDA or under
``TRITON_INTERPRET=1``, PyTorch otherwise); both are gathers (no atomics), so they are
deterministic, and their backwards are the opposite gathers. They are ``triton_op``s: ``torch.compile``
traces their bodies and launches the Triton kernels from the compiled graph, with no custom-op
dispatch (about 100 us of host time per call).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from plait.kernels._dispatch import use_triton

__all__ = ["RowIdMap", "permute", "permuted_rows", "unpermute"]


@dataclass(frozen=True)
class RowIdMap:
    """Where each token's copies live in the permuted buffer (returned by :func:`permute`).

    Attributes:
        src: ``[M]`` int64 source token of each permuted row, ``-1`` for padding rows.
        dst: ``[T, k]`` int64 permuted row of each of a token's copies, ``-1`` for skipped choices.
        rows: ``[1]`` int64, the rows the groups occupy (their padding included), or None (every
            row): the rows at or past it are neither written by :func:`permute` nor given a gradient
            by :func:`unpermute` (unspecified values; nothing reads them).
    """

    src: torch.Tensor
    dst: torch.Tensor
    rows: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.dst.shape[0]


def permuted_rows(num_tokens: int, top_k: int, num_experts: int, align: int = 1) -> int:
    """Rows of :func:`permute`'s output: ``T * k + E * (align - 1)``, an upper bound of the padded groups."""
    return num_tokens * top_k + num_experts * (align - 1)


# --- row movement: custom ops (Triton or PyTorch inside) -------------------------------------------


def _gather_torch(x: torch.Tensor, src: torch.Tensor, w_rows: torch.Tensor | None) -> torch.Tensor:
    # Every row, past ``num_rows`` too (zeros there): the bound only saves the Triton path's traffic.
    if x.shape[0] == 0:  # every row is padding
        return x.new_zeros((src.shape[0], x.shape[1]))
    rows = x.index_select(0, src.clamp(min=0))
    if w_rows is not None:
        rows = (rows.float() * w_rows.float().unsqueeze(1)).to(x.dtype)
    return torch.where((src >= 0).unsqueeze(1), rows, 0)


def _combine_torch(x: torch.Tensor, dst: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor:
    if x.shape[0] == 0:  # no copies anywhere
        return x.new_zeros((dst.shape[0], x.shape[1]))
    rows = x.index_select(0, dst.clamp(min=0).reshape(-1)).view(*dst.shape, x.shape[1]).float()
    if w is not None:
        rows = rows * w.float().unsqueeze(-1)
    # where, not a multiply: rows that no copy uses may hold anything (e.g. uncomputed gmm rows).
    return torch.where((dst >= 0).unsqueeze(-1), rows, 0.0).sum(1).to(x.dtype)


def _row_dots_torch(dy: torch.Tensor, x: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    if x.shape[0] == 0:
        return dy.new_zeros(dst.shape, dtype=torch.float32)
    rows = x.index_select(0, dst.clamp(min=0).reshape(-1)).view(*dst.shape, x.shape[1]).float()
    dots = (rows * dy.float().unsqueeze(1)).sum(-1)
    return torch.where(dst >= 0, dots, 0.0)


def _gather(
    x: torch.Tensor, src: torch.Tensor, w_rows: torch.Tensor | None, num_rows: torch.Tensor | None
) -> torch.Tensor:
    if use_triton(*(t for t in (x, src, num_rows) if t is not None)):
        from plait.kernels._triton.permute import gather_rows

        return gather_rows(x, src, w_rows, num_rows)
    return _gather_torch(x, src, w_rows)


def _combine(x: torch.Tensor, dst: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor:
    if use_triton(x, dst):
        from plait.kernels._triton.permute import combine_rows

        return combine_rows(x.contiguous(), dst, w)
    return _combine_torch(x, dst, w)


@torch.library.triton_op(
    "plait::permute_rows",
    mutates_args=(),
    schema="(Tensor x, Tensor src, Tensor dst, Tensor? num_rows=None) -> Tensor",
)
def _permute_rows(
    x: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, num_rows: torch.Tensor | None = None
) -> torch.Tensor:
    """``out[m] = x[src[m]]`` (0 where ``src[m] < 0``) for ``m < num_rows`` (unspecified past it on
    the Triton path); ``dst`` is the inverse map, for the backward."""
    return _gather(x, src, None, num_rows)


@torch.library.triton_op(
    "plait::unpermute_rows",
    mutates_args=(),
    schema="(Tensor x, Tensor src, Tensor dst, Tensor? w, Tensor? w_rows, Tensor? num_rows=None) -> Tensor",
)
def _unpermute_rows(
    x: torch.Tensor,
    src: torch.Tensor,
    dst: torch.Tensor,
    w: torch.Tensor | None,
    w_rows: torch.Tensor | None,
    num_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out[t] = sum_j w[t, j] * x[dst[t, j]]`` over ``dst >= 0`` (fp32 accumulation).

    ``src``, ``w_rows`` (each row's weight, 0 on padding) and ``num_rows`` (the rows given a
    gradient) serve the backward.
    """
    return _combine(x, dst, w)


@torch.library.triton_op(
    "plait::row_dots", mutates_args=(), schema="(Tensor dy, Tensor x, Tensor dst) -> Tensor"
)
def _row_dots(dy: torch.Tensor, x: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """``out[t, j] = <dy[t], x[dst[t, j]]>`` in fp32 (0 where ``dst < 0``)."""
    if use_triton(dy, x, dst):
        from plait.kernels._triton.permute import row_dots

        return row_dots(dy.contiguous(), x.contiguous(), dst)
    return _row_dots_torch(dy, x, dst)


@torch.library.triton_op(
    "plait::gather_rows",
    mutates_args=(),
    schema="(Tensor x, Tensor src, Tensor? w_rows, Tensor? num_rows=None) -> Tensor",
)
def _gather_rows(
    x: torch.Tensor, src: torch.Tensor, w_rows: torch.Tensor | None, num_rows: torch.Tensor | None = None
) -> torch.Tensor:
    """``out[m] = x[src[m]] * w_rows[m]`` (0 where ``src[m] < 0``) for ``m < num_rows``; the backward
    of a combine."""
    return _gather(x, src, w_rows, num_rows)


@torch.library.triton_op("plait::combine_rows", mutates_args=(), schema="(Tensor x, Tensor dst) -> Tensor")
def _combine_rows(x: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """``out[t] = sum_j x[dst[t, j]]`` over ``dst >= 0``; the backward of a permute."""
    return _combine(x, dst, None)


def _permute_setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    _x, _src, dst, _num_rows = inputs
    ctx.save_for_backward(dst)


def _permute_backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
    (dst,) = ctx.saved_tensors
    return _combine_rows(dy.contiguous(), dst), None, None, None


def _unpermute_setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    x, src, dst, w, w_rows, num_rows = inputs
    ctx.save_for_backward(x if w is not None else None, src, dst, w_rows, num_rows)
    ctx.has_w = w is not None


def _unpermute_backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
    x, src, dst, w_rows, num_rows = ctx.saved_tensors
    dy = dy.contiguous()
    dx = _gather_rows(dy, src, w_rows, num_rows) if ctx.needs_input_grad[0] else None
    dw = None
    if ctx.has_w and ctx.needs_input_grad[3]:
        dw = _row_dots(dy, x.contiguous(), dst)
    return dx, None, None, dw, None, None


_permute_rows.register_autograd(_permute_backward, setup_context=_permute_setup)
_unpermute_rows.register_autograd(_unpermute_backward, setup_context=_unpermute_setup)


# --- public API ------------------------------------------------------------------------------------


def permute(
    tokens: torch.Tensor,
    topk_idx: torch.Tensor,
    num_experts: int,
    probs: torch.Tensor | None = None,
    align: int = 1,
    max_rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, RowIdMap, torch.Tensor]:
    """Copy tokens into expert-contiguous order (no device-to-host synchronisation).

    Args:
        tokens: ``[T, H]``.
        topk_idx: ``[T, k]`` integer expert of each of a token's copies; values outside
            ``[0, num_experts)`` are skipped (dropped slots, other ranks' experts).
        num_experts: ``E``.
        probs: optional ``[T, k]`` routing weights (same layout as ``topk_idx``); returned in
            permuted order (differentiable).
        align: pad each expert's group with zero rows to a multiple of this.
        max_rows: cap on the output rows (``None``: the exact bound, nothing can overflow). Rows
            of the groups at or past it are not written: their copies get ``dst == -1`` (unpermute
            adds nothing for them, their gradients are zero).

    Returns:
        ``(permuted [M, H], permuted_probs [M] | None, row_id_map, tokens_per_expert [E] int64)``
        with ``M = min(permuted_rows(T, k, E, align), max_rows)``. ``tokens_per_expert`` counts each
        expert's rows *including* alignment padding (what :func:`plait.kernels.gmm` needs). Without
        overflow it sums to at most ``M``. It is never truncated: a sum above ``M`` means the buffer
        overflowed (detect it on the device; clamp the groups to ``M`` rows before a grouped GEMM).
        The padding rows inside the groups are zero with ``permuted_probs == 0``; the rows after
        the groups (``row_id_map.rows`` on) are not written on the Triton path (unspecified; a
        buffer sized by a static bound, e.g. the all-gather dispatch's, is mostly such rows there).

    Raises:
        ValueError: malformed shapes or dtypes, ``num_experts < 1``, ``align < 1``, ``max_rows < 0``.
    """
    if tokens.dim() != 2 or topk_idx.dim() != 2 or topk_idx.shape[0] != tokens.shape[0]:
        raise ValueError(
            f"permute: tokens {tuple(tokens.shape)} must be [T, H] and topk_idx {tuple(topk_idx.shape)} [T, k]"
        )
    if topk_idx.dtype.is_floating_point or topk_idx.dtype == torch.bool:
        raise ValueError(f"permute: topk_idx must be an integer tensor, got {topk_idx.dtype}")
    if probs is not None and probs.shape != topk_idx.shape:
        raise ValueError(f"permute: probs {tuple(probs.shape)} must match topk_idx {tuple(topk_idx.shape)}")
    if num_experts < 1:
        raise ValueError(f"permute: num_experts must be >= 1, got {num_experts}")
    if align < 1:
        raise ValueError(f"permute: align must be >= 1, got {align}")
    if max_rows is not None and (
        isinstance(max_rows, bool) or not isinstance(max_rows, int | torch.SymInt) or max_rows < 0
    ):
        raise ValueError(f"permute: max_rows must be an int >= 0 or None, got {max_rows!r}")
    t, k = topk_idx.shape
    dev = topk_idx.device
    m = permuted_rows(t, k, num_experts, align)
    if max_rows is not None:
        m = min(m, max_rows)
    flat = topk_idx.reshape(-1).long()
    key = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)  # skipped -> E, sorts last
    order = torch.sort(key, stable=True).indices  # sorted position -> choice (expert-major, token order)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=dev).scatter_add_(
        0, key, torch.ones_like(key)
    )
    padded = (counts[:num_experts] + align - 1) // align * align
    start_pad = torch.cumsum(padded, 0) - padded
    start_real = torch.cumsum(counts, 0) - counts
    e_sorted = key[order]
    kept = e_sorted < num_experts
    rank_in_expert = torch.arange(t * k, device=dev) - start_real[e_sorted]
    # Row of each sorted choice; skipped ones, and those past a max_rows cap, go to a scratch row m,
    # cut off below.
    row = torch.where(kept, start_pad[e_sorted.clamp(max=num_experts - 1)] + rank_in_expert, m).clamp(max=m)
    choice_of_row = torch.full((m + 1,), -1, dtype=torch.long, device=dev).scatter_(0, row, order)[:m]
    row_of_choice = torch.empty_like(row).scatter_(0, order, row)
    used = choice_of_row >= 0
    src = torch.where(used, choice_of_row // k, -1)
    dst = torch.where(row_of_choice < m, row_of_choice, -1).view(t, k)
    used_rows = padded.sum(0, keepdim=True)
    row_map = RowIdMap(src=src, dst=dst, rows=used_rows)
    permuted_probs = None
    if probs is not None:
        # Scattered by each choice's row (the skipped ones into the scratch row m, cut off), not
        # gathered by each row's choice: the backward is then a gather. An index's backward would
        # accumulate every unused row into one element, one at a time on CUDA (the sort-based
        # index_put): 5.6 ms a step for the all-gather dispatch's mostly unused P*T*k rows on an H200.
        permuted_probs = probs.new_zeros(m + 1).scatter(0, row_of_choice, probs.reshape(-1))[:m]
    permuted = _permute_rows(tokens, src, dst, used_rows)
    return permuted, permuted_probs, row_map, padded


def unpermute(
    permuted: torch.Tensor, row_id_map: RowIdMap, probs: torch.Tensor | None = None
) -> torch.Tensor:
    """Sum each token's expert outputs back into token order, optionally weighted.

    Rows that no copy maps to (padding, the tail of :func:`permute`'s buffer) are never read, and
    the tail (``row_id_map.rows`` on) gets no gradient written on the Triton path (unspecified).

    Args:
        permuted: ``[M, H]`` rows in the order produced by :func:`permute`.
        row_id_map: the :class:`RowIdMap` from :func:`permute`.
        probs: optional weights, fp32 math (differentiable): ``[M]`` in permuted order
            (``permuted_probs``) or ``[T, k]`` in ``topk_idx`` order.

    Returns:
        ``[T, H]`` in ``permuted.dtype``.
    """
    if not isinstance(row_id_map, RowIdMap):
        raise TypeError(
            f"unpermute: row_id_map must be the RowIdMap returned by permute, got {type(row_id_map).__name__}"
        )
    dst, src = row_id_map.dst, row_id_map.src
    if permuted.dim() != 2 or permuted.shape[0] != src.shape[0]:
        raise ValueError(f"unpermute: permuted {tuple(permuted.shape)} must be [{src.shape[0]}, H]")
    used = dst >= 0
    w = w_rows = None  # [T, k] weight of each copy; [M] weight of each row (for the backward)
    if probs is not None:
        if probs.dim() == 1 and probs.shape[0] == src.shape[0]:
            # Skipped copies read a zero appended at row M (an empty buffer has no row 0). A gather:
            # its backward scatter-adds (an index's would accumulate the skipped copies one by one).
            padded = torch.cat([probs.float(), probs.new_zeros(1, dtype=torch.float32)])
            w = padded.gather(0, torch.where(used, dst, src.shape[0]).reshape(-1)).view(dst.shape)
            w_rows = torch.where(src >= 0, probs.detach().float(), 0.0)
        elif tuple(probs.shape) == tuple(dst.shape):
            w = torch.where(used, probs.float(), 0.0)
            w_rows = torch.zeros(src.shape[0] + 1, dtype=torch.float32, device=w.device)
            w_rows = w_rows.scatter(
                0, torch.where(used, dst, src.shape[0]).reshape(-1), w.detach().reshape(-1)
            )
            w_rows = w_rows[: src.shape[0]]
        else:
            raise ValueError(
                f"unpermute: probs {tuple(probs.shape)} must be [M={src.shape[0]}] (permuted order) or "
                f"[T, k]={tuple(dst.shape)}"
            )
    return _unpermute_rows(permuted, src, dst, w, w_rows, row_id_map.rows)  # type: ignore[no-any-return]
