"""Triton per-tile steps of the blockwise linear cross-entropy: one program per token row of a
``[chunk, block]`` logit tile; fp32 math, the backward writes ``dlogits`` over the tile in place."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _tanh(x):
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def _stats_kernel(
    l_ptr, t_ptr, m_ptr, s_ptr, tgt_ptr, n_cols, stride, softcap,
    HAS_CAP: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    z = tl.load(l_ptr + row * stride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_CAP:
        z = softcap * _tanh(z / softcap)
    z = tl.where(mask, z, -float("inf"))
    m_old = tl.load(m_ptr + row)
    m_new = tl.maximum(m_old, tl.max(z, axis=0))
    s = tl.load(s_ptr + row) * tl.exp(m_old - m_new) + tl.sum(tl.exp(z - m_new), axis=0)
    tl.store(m_ptr + row, m_new)
    tl.store(s_ptr + row, s)
    t = tl.load(t_ptr + row)
    hit = tl.sum(tl.where((cols == t) & mask, z, 0.0), axis=0)
    tl.store(tgt_ptr + row, tl.load(tgt_ptr + row) + hit)


@triton.jit
def _grad_kernel(
    l_ptr, t_ptr, lse_ptr, gp_ptr, gt_ptr, n_cols, stride, softcap,
    HAS_CAP: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    z = tl.load(l_ptr + row * stride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_CAP:
        th = _tanh(z / softcap)
        z = softcap * th
    lse = tl.load(lse_ptr + row)
    gp = tl.load(gp_ptr + row)
    gt = tl.load(gt_ptr + row)
    t = tl.load(t_ptr + row)
    d = tl.exp(z - lse) * gp - tl.where(cols == t, gt, 0.0)
    if HAS_CAP:
        d = d * (1.0 - th * th)
    tl.store(l_ptr + row * stride + cols, d.to(l_ptr.dtype.element_ty), mask=mask)


def _cfg(n: int) -> tuple[int, int]:
    block = triton.next_power_of_2(max(n, 16))
    return block, (4 if block <= 1024 else (8 if block <= 4096 else 16))


def tile_stats_triton(
    logits: torch.Tensor,
    local_t: torch.Tensor,
    m: torch.Tensor,
    s: torch.Tensor,
    tgt: torch.Tensor,
    softcap: float | None,
) -> None:
    """Fold a logit tile into the running (max, sum-exp, target logit) of its rows, in place."""
    rows, n = logits.shape
    if rows == 0:
        return
    block, warps = _cfg(n)
    _stats_kernel[(rows,)](
        logits, local_t, m, s, tgt, n, logits.stride(0), float(softcap or 1.0),
        HAS_CAP=softcap is not None, BLOCK=block, num_warps=warps,
    )  # fmt: skip


def tile_grad_triton(
    logits: torch.Tensor,
    local_t: torch.Tensor,
    lse: torch.Tensor,
    g_p: torch.Tensor,
    g_t: torch.Tensor,
    softcap: float | None,
) -> torch.Tensor:
    """Overwrite a logit tile with its gradient ``g_p * softmax - g_t * onehot`` (soft-cap aware)."""
    rows, n = logits.shape
    if rows:
        block, warps = _cfg(n)
        _grad_kernel[(rows,)](
            logits, local_t, lse, g_p.contiguous(), g_t.contiguous(), n, logits.stride(0), float(softcap or 1.0),
            HAS_CAP=softcap is not None, BLOCK=block, num_warps=warps,
        )  # fmt: skip
    return logits


# --- one-pass mode: a whole [chunk, V] logits tile, one program per row looping over its columns ----


@triton.jit
def _row_loss_grad_kernel(
    l_ptr, t_ptr, loss_ptr, n_cols, stride, z_loss, softcap,
    HAS_CAP: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    base = l_ptr + row * stride
    t = tl.load(t_ptr + row)
    # Pass 1: per-lane running max and sum-exp (finite sentinel: lanes past n_cols never hold a logit).
    m = tl.full([BLOCK], -1e30, tl.float32)
    s = tl.zeros([BLOCK], tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        z = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_CAP:
            z = softcap * _tanh(z / softcap)
        z = tl.where(mask, z, -1e30)
        m_new = tl.maximum(m, z)
        s = s * tl.exp(m - m_new) + tl.exp(z - m_new)
        m = m_new
    m_row = tl.max(m, axis=0)
    lse = m_row + tl.log(tl.sum(s * tl.exp(m - m_row), axis=0))
    valid = t >= 0
    # The target's logit; a target outside the row reads nothing and adds nothing (as the tile kernels).
    hit = valid & (t < n_cols)
    zt = tl.load(base + tl.minimum(tl.maximum(t, 0), n_cols - 1)).to(tl.float32)
    if HAS_CAP:
        zt = softcap * _tanh(zt / softcap)
    zt = tl.where(hit, zt, 0.0)
    tl.store(loss_ptr + row, tl.where(valid, lse - zt + z_loss * lse * lse, 0.0))
    # Pass 2: dlogits of the summed loss in place: (1 + 2 z lse) * softmax - onehot on valid rows.
    gp = tl.where(valid, 1.0 + 2.0 * z_loss * lse, 0.0)
    gt = tl.where(valid, 1.0, 0.0)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        z = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_CAP:
            th = _tanh(z / softcap)
            z = softcap * th
        d = tl.exp(z - lse) * gp - tl.where(cols == t, gt, 0.0)
        if HAS_CAP:
            d = d * (1.0 - th * th)
        tl.store(base + cols, d.to(l_ptr.dtype.element_ty), mask=mask)


def row_loss_grad_triton(
    logits: torch.Tensor,
    local_t: torch.Tensor,
    loss: torch.Tensor,
    z_loss: float,
    softcap: float | None,
    block: int,
) -> None:
    """Per row of a whole-vocabulary tile: its loss into ``loss`` (0 where ``local_t < 0``), and the
    tile overwritten with the gradient of the summed loss. ``block``: columns per loop step."""
    rows, n = logits.shape
    if rows == 0:
        return
    blk, warps = _cfg(min(n, block))
    _row_loss_grad_kernel[(rows,)](
        logits, local_t, loss, n, logits.stride(0), float(z_loss), float(softcap or 1.0),
        HAS_CAP=softcap is not None, BLOCK=blk, num_warps=warps,
    )  # fmt: skip


@triton.jit
def _scale_kernel(x_ptr, g_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, (x * tl.load(g_ptr)).to(out_ptr.dtype.element_ty), mask=mask)


def scale_triton(x: torch.Tensor, g: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    """``x * g`` (``g`` a 0-d fp32 tensor) in fp32 arithmetic, in ``x``'s dtype, one pass (into ``x``
    itself with ``inplace``)."""
    out = x if inplace else torch.empty_like(x)
    n = x.numel()
    if n:
        _scale_kernel[(triton.cdiv(n, 4096),)](x, g.reshape(1), out, n, BLOCK=4096, num_warps=8)
    return out
