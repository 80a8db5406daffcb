"""MoE token permutation: routing maps, expert-contiguous permute, weighted unpermute.

``permute`` lays the routed copies of the tokens out expert by expert (expert 0's tokens first),
stable in token order inside each expert, each expert's group zero-padded to a multiple of
``align`` (grouped-GEMM kernels like 8/16/128-row aligned groups). ``unpermute`` sums each token's
copies back, optionally weighted by the routing probabilities. Both are gathers (no atomics), so
they are deterministic; their backwards are the opposite gathers. Index bookkeeping is PyTorch;
the row movement is a Triton kernel on CUDA (or under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from plait.kernels._dispatch import use_triton

__all__ = ["RowIdMap", "permute", "topk_to_routing_map", "unpermute"]


@dataclass(frozen=True)
class RowIdMap:
    """Where each token's copies live in the permuted buffer (returned by :func:`permute`).

    Attributes:
        src: ``[M]`` int64 source token of each permuted row, ``-1`` for padding rows.
        dst: ``[T, K]`` int64 permuted row of each of a token's copies, ``-1`` for unused slots
            (``K`` = most experts any token is routed to).
        experts: ``[T, K]`` int64 expert of each copy (``-1`` for unused slots).
    """

    src: torch.Tensor
    dst: torch.Tensor
    experts: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return self.dst.shape[0]


def topk_to_routing_map(
    topk_idx: torch.Tensor, topk_probs: torch.Tensor, num_experts: int, expert_offset: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Turn top-k expert choices into a multi-hot routing map and a dense probability matrix.

    Args:
        topk_idx: ``[T, k]`` integer expert ids.
        topk_probs: ``[T, k]`` routing weights (differentiable).
        num_experts: number of (local) experts ``E``.
        expert_offset: id of the first local expert; choices outside
            ``[expert_offset, expert_offset + E)`` are dropped (expert parallelism).

    Returns:
        ``routing_map`` bool ``[T, E]`` and ``probs`` fp32 ``[T, E]`` (zero where not routed).
    """
    if topk_idx.shape != topk_probs.shape or topk_idx.dim() != 2:
        raise ValueError(
            f"topk_to_routing_map: topk_idx {tuple(topk_idx.shape)} and topk_probs {tuple(topk_probs.shape)} must both be [T, k]"
        )
    if num_experts < 1:
        raise ValueError(f"topk_to_routing_map: num_experts must be >= 1, got {num_experts}")
    local = topk_idx.long() - expert_offset
    inside = (local >= 0) & (local < num_experts)
    idx = torch.where(inside, local, 0)
    t = topk_idx.shape[0]
    hits = torch.zeros((t, num_experts), dtype=torch.int32, device=topk_idx.device).scatter_add_(
        1, idx, inside.int()
    )
    routing_map = hits > 0
    probs = torch.zeros((t, num_experts), dtype=torch.float32, device=topk_idx.device).scatter_add(
        1, idx, torch.where(inside, topk_probs.float(), 0.0)
    )
    return routing_map, probs


def _row_id_map(routing_map: torch.Tensor, align: int) -> tuple[RowIdMap, torch.Tensor]:
    t, _e = routing_map.shape
    dev = routing_map.device
    counts = routing_map.sum(0)
    padded = (counts + align - 1) // align * align
    e_idx, t_idx = routing_map.T.nonzero(as_tuple=True)  # expert-major, token order inside (stable)
    start_real = torch.cumsum(counts, 0) - counts
    start_pad = torch.cumsum(padded, 0) - padded
    rows = start_pad[e_idx] + (torch.arange(e_idx.numel(), device=dev) - start_real[e_idx])
    m = int(padded.sum())
    src = torch.full((m,), -1, dtype=torch.long, device=dev)
    src[rows] = t_idx
    per_token = routing_map.sum(1)
    k = int(per_token.max()) if t else 0
    slot = torch.cumsum(routing_map.long(), 1) - 1
    dst = torch.full((t, max(k, 1)), -1, dtype=torch.long, device=dev)
    experts = torch.full_like(dst, -1)
    s = slot[t_idx, e_idx]
    dst[t_idx, s] = rows
    experts[t_idx, s] = e_idx
    return RowIdMap(src=src, dst=dst, experts=experts), padded.long()


class _PermuteRows(torch.autograd.Function):
    """Triton row gather ``out[m] = x[src[m]]`` (0 for padding); backward sums copies via ``dst``."""

    @staticmethod
    def forward(ctx, x, src, dst):  # type: ignore[override]
        from plait.kernels._triton.permute import gather_rows

        ctx.save_for_backward(src, dst)
        return gather_rows(x, src, None)

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        from plait.kernels._triton.permute import combine_rows

        _src, dst = ctx.saved_tensors
        return combine_rows(dy.contiguous(), dst, None), None, None


class _CombineRows(torch.autograd.Function):
    """Triton ``out[t] = sum_j w[t, j] * x[dst[t, j]]``; backward gathers ``dout`` back per row."""

    @staticmethod
    def forward(ctx, x, src, dst, w, w_rows):  # type: ignore[override]
        from plait.kernels._triton.permute import combine_rows

        ctx.save_for_backward(x, src, dst, w, w_rows)
        return combine_rows(x.contiguous(), dst, w)

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        from plait.kernels._triton.permute import gather_rows, row_dots

        x, src, dst, w, w_rows = ctx.saved_tensors
        dy = dy.contiguous()
        dx = gather_rows(dy, src, w_rows) if ctx.needs_input_grad[0] else None
        dw = None
        if w is not None and ctx.needs_input_grad[3]:
            dw = row_dots(dy, x.contiguous(), dst).to(w.dtype)
        return dx, None, None, dw, None


def permute(
    tokens: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor | None = None, align: int = 1
) -> tuple[torch.Tensor, torch.Tensor | None, RowIdMap, torch.Tensor]:
    """Copy tokens into expert-contiguous order.

    Args:
        tokens: ``[T, H]``.
        routing_map: bool ``[T, E]``: token t goes to expert e.
        probs: optional ``[T, E]`` routing weights; returned in permuted order (differentiable).
        align: pad each expert's group with zero rows to a multiple of this.

    Returns:
        ``(permuted [M, H], permuted_probs [M] | None (0 on padding rows), row_id_map,
        tokens_per_expert [E] int64)``, where ``tokens_per_expert`` counts each expert's rows in
        ``permuted`` *including padding* (what :func:`plait.kernels.gmm` needs). This synchronises
        with the device once (``M`` is data-dependent).
    """
    if tokens.dim() != 2 or routing_map.dim() != 2 or routing_map.shape[0] != tokens.shape[0]:
        raise ValueError(
            f"permute: tokens {tuple(tokens.shape)} must be [T, H] and routing_map {tuple(routing_map.shape)} [T, E]"
        )
    if routing_map.dtype != torch.bool:
        raise ValueError(f"permute: routing_map must be bool, got {routing_map.dtype}")
    if probs is not None and probs.shape != routing_map.shape:
        raise ValueError(
            f"permute: probs {tuple(probs.shape)} must match routing_map {tuple(routing_map.shape)}"
        )
    if align < 1:
        raise ValueError(f"permute: align must be >= 1, got {align}")
    row_map, tpe = _row_id_map(routing_map, align)
    src = row_map.src
    valid = src >= 0
    permuted_probs = None
    if probs is not None:
        e_of_row = torch.repeat_interleave(
            torch.arange(tpe.numel(), device=tpe.device), tpe, output_size=src.numel()
        )
        flat = probs.reshape(-1)
        permuted_probs = torch.where(valid, flat[src.clamp(min=0) * probs.shape[1] + e_of_row], 0.0)
    if use_triton(tokens):
        permuted = _PermuteRows.apply(tokens, src, row_map.dst)
    else:
        permuted = tokens.index_select(0, src.clamp(min=0)) * valid.unsqueeze(1).to(tokens.dtype)
    return permuted, permuted_probs, row_map, tpe


def unpermute(
    permuted: torch.Tensor, row_id_map: RowIdMap, num_tokens: int, probs: torch.Tensor | None = None
) -> torch.Tensor:
    """Sum each token's expert outputs back into token order, optionally weighted.

    Args:
        permuted: ``[M, H]`` rows in the order produced by :func:`permute`.
        row_id_map: the :class:`RowIdMap` from :func:`permute`.
        num_tokens: ``T`` (checked against the map).
        probs: optional weights: ``[M]`` in permuted order (``permuted_probs``) or ``[T, E]``
            dense routing probabilities. Weighting happens in fp32 (differentiable).

    Returns:
        ``[T, H]`` in ``permuted.dtype``.
    """
    if not isinstance(row_id_map, RowIdMap):
        raise TypeError(
            f"unpermute: row_id_map must be the RowIdMap returned by permute, got {type(row_id_map).__name__}"
        )
    if num_tokens != row_id_map.num_tokens:
        raise ValueError(
            f"unpermute: num_tokens={num_tokens} but row_id_map was built for {row_id_map.num_tokens} tokens"
        )
    if permuted.dim() != 2 or permuted.shape[0] != row_id_map.src.shape[0]:
        raise ValueError(
            f"unpermute: permuted {tuple(permuted.shape)} must be [{row_id_map.src.shape[0]}, H]"
        )
    dst, src = row_id_map.dst, row_id_map.src
    used = dst >= 0
    w = None  # [T, K] weight of each copy
    if probs is not None:
        if probs.dim() == 1 and probs.shape[0] == src.shape[0]:
            w = torch.where(used, probs[dst.clamp(min=0)].float(), 0.0)
        elif probs.dim() == 2 and probs.shape[0] == num_tokens:
            e = row_id_map.experts
            w = torch.where(used, probs.float().gather(1, e.clamp(min=0)), 0.0)
        else:
            raise ValueError(
                f"unpermute: probs {tuple(probs.shape)} must be [M={src.shape[0]}] (permuted order) or [T={num_tokens}, E]"
            )
    if use_triton(permuted):
        w_rows = None
        if w is not None:
            # Per permuted row weight for the backward gather (0 on padding rows).
            w_rows = torch.zeros(src.shape[0], dtype=torch.float32, device=w.device)
            w_rows[dst[used]] = w.detach()[used]
        return _CombineRows.apply(permuted, src, dst, w, w_rows)
    rows = permuted.index_select(0, dst.clamp(min=0).reshape(-1)).view(*dst.shape, -1).float()
    scale = used.float() if w is None else w
    return (rows * scale.unsqueeze(-1)).sum(1).to(permuted.dtype)
