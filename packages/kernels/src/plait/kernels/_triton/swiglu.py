"""Triton SwiGLU forward/backward: tiles of whole rows (several per program when rows are short), fp32
math, silu recomputed in backward. With a row count on the device (``n``), rows at or past it are
neither read nor written. Launched through ``wrap_triton`` (the ops calling them are ``triton_op``s)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton


@triton.jit
def _live_rows(n_ptr, n_rows, ROWS: tl.constexpr, HAS_N: tl.constexpr):
    """This program's rows and which of them are computed (inside the tensor, and below ``*n_ptr``)."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    live = rows < n_rows
    if HAS_N:
        live = live & (rows < tl.load(n_ptr))
    return rows, live


@triton.jit
def _swiglu_fwd(
    g_ptr, u_ptr, w_ptr, n_ptr, y_ptr, n_rows, n_cols, in_stride, out_stride,
    HAS_W: tl.constexpr, HAS_N: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    rows, live = _live_rows(n_ptr, n_rows, ROWS, HAS_N)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = live[:, None] & (cols < n_cols)[None, :]
    at = rows[:, None] * in_stride + cols[None, :]
    g = tl.load(g_ptr + at, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + at, mask=mask, other=0.0).to(tl.float32)
    y = g * tl.sigmoid(g) * u
    if HAS_W:
        y = y * tl.load(w_ptr + rows, mask=live, other=0.0).to(tl.float32)[:, None]
    tl.store(y_ptr + rows[:, None] * out_stride + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd(
    dy_ptr, g_ptr, u_ptr, w_ptr, n_ptr, dg_ptr, du_ptr, dwp_ptr, n_rows, n_cols, in_stride, dy_stride,
    n_col_blocks, HAS_W: tl.constexpr, NEED_DW: tl.constexpr, HAS_N: tl.constexpr, ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    rows, live = _live_rows(n_ptr, n_rows, ROWS, HAS_N)
    cb = tl.program_id(1)
    cols = cb * BLOCK + tl.arange(0, BLOCK)
    mask = live[:, None] & (cols < n_cols)[None, :]
    at = rows[:, None] * in_stride + cols[None, :]
    dy = tl.load(dy_ptr + rows[:, None] * dy_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + at, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + at, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    silu = g * s
    if NEED_DW:
        # d row_weight = sum_cols dy * silu * up; one partial per column block, summed by torch.
        tl.store(dwp_ptr + rows * n_col_blocks + cb, tl.sum(dy * silu * u, axis=1), mask=live)
    if HAS_W:
        dy = dy * tl.load(w_ptr + rows, mask=live, other=0.0).to(tl.float32)[:, None]
    dg = dy * u * s * (1.0 + g * (1.0 - s))
    du = dy * silu
    tl.store(dg_ptr + at, dg.to(dg_ptr.dtype.element_ty), mask=mask)
    tl.store(du_ptr + at, du.to(du_ptr.dtype.element_ty), mask=mask)


def _block(n_cols: int) -> int:
    # Whole rows up to 8192 columns per program (fewer, longer programs stream better).
    return min(8192, triton.next_power_of_2(max(n_cols, 16)))


def _warps(block: int) -> int:
    return 16 if block >= 8192 else (8 if block >= 2048 else 4)


def _rows(block: int, elements: int) -> int:
    """Rows per program: short rows (e.g. a MoE expert's 512-wide SwiGLU) share a program up to
    ``elements`` per tile; rows of ``elements`` columns or more get one program each."""
    return max(1, elements // block)


def swiglu_forward(
    a: torch.Tensor, b: torch.Tensor | None, w: torch.Tensor | None, n: torch.Tensor | None = None
) -> torch.Tensor:
    """Triton SwiGLU; ``b is None`` means ``a`` is the fused ``[..., 2I]`` tensor; rows at or past ``n``
    (a one-element integer tensor) are not computed."""
    a = a.contiguous()
    if b is None:
        cols = a.shape[-1] // 2
        a2 = a.view(-1, 2 * cols)
        gate, up = a2, a2[:, cols:]
        in_stride = 2 * cols
    else:
        b = b.contiguous()
        cols = a.shape[-1]
        gate, up = a.view(-1, cols), b.view(-1, cols)
        in_stride = cols
    rows = gate.shape[0]
    y = torch.empty((*a.shape[:-1], cols), dtype=a.dtype, device=a.device)
    wf = w.contiguous().view(-1) if w is not None else None
    block = _block(cols)
    per = _rows(block, 4096)
    if rows and cols:
        wrap_triton(_swiglu_fwd)[(triton.cdiv(rows, per), triton.cdiv(cols, block))](
            gate, up, wf if wf is not None else gate, n if n is not None else gate, y, rows, cols,
            in_stride, cols, HAS_W=wf is not None, HAS_N=n is not None, ROWS=per, BLOCK=block,
            num_warps=_warps(block),
        )  # fmt: skip
    return y


def swiglu_backward(
    dy: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor | None,
    w: torch.Tensor | None,
    need_dw: bool,
    n: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(da, db, dw)``: ``db`` is None when fused, ``dw`` None unless ``need_dw`` and ``w`` is given;
    rows at or past ``n`` get unspecified gradients."""
    a = a.contiguous()
    fused = b is None
    cols = a.shape[-1] // 2 if fused else a.shape[-1]
    dy = dy.contiguous().view(-1, cols)
    dgb = None
    if b is None:
        a2 = a.view(-1, 2 * cols)
        gate, up = a2, a2[:, cols:]
        dga = torch.empty_like(a)
        d2 = dga.view(-1, 2 * cols)
        dgate, dup = d2, d2[:, cols:]
        in_stride = 2 * cols
    else:
        b = b.contiguous()
        gate, up = a.view(-1, cols), b.view(-1, cols)
        dga, dgb = torch.empty_like(a), torch.empty_like(b)
        dgate, dup = dga.view(-1, cols), dgb.view(-1, cols)
        in_stride = cols
    rows = gate.shape[0]
    wf = w.contiguous().view(-1) if w is not None else None
    need_dw = need_dw and wf is not None
    # With the row-weight gradient, column blocks of 2048 on 4 warps and a torch sum of the partials
    # beat whole rows (on an H100 at 16384 x 8192: 0.468 against 0.502 ms, the sum included).
    block = min(_block(cols), 2048) if need_dw else _block(cols)
    warps = 4 if need_dw else _warps(block)
    per = _rows(block, 2048)
    ncb = triton.cdiv(cols, block) if cols else 1
    dwp = torch.empty((rows, ncb), dtype=torch.float32, device=a.device) if need_dw else None
    if rows and cols:
        wrap_triton(_swiglu_bwd)[(triton.cdiv(rows, per), ncb)](
            dy, gate, up, wf if wf is not None else gate, n if n is not None else gate, dgate, dup,
            dwp if dwp is not None else dy, rows, cols, in_stride, cols, ncb,
            HAS_W=wf is not None, NEED_DW=need_dw, HAS_N=n is not None, ROWS=per, BLOCK=block,
            num_warps=warps,
        )  # fmt: skip
    dw = None
    if need_dw:
        assert dwp is not None and w is not None
        # one column block (I <= 2048): the partials are the sums, no reduction kernel
        dw = (dwp[:, 0] if ncb == 1 else dwp.sum(1)).view(w.shape).to(w.dtype)
    return dga, dgb, dw
