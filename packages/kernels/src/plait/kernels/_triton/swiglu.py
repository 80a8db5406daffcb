"""Triton SwiGLU forward/backward: tiles of whole rows (several per tile when rows are short), fp32
math, silu recomputed in backward. With a row count on the device (``n``), rows at or past it are
neither read nor written: a program whose tile lies past it returns at once, so a launch over a
buffer that a static bound sizes at ``P`` times its use costs about what one over the used part
does (on an H200, the all-gather dispatch's backward over twice its used rows: 0.103 against 0.093 ms
per layer; a grid-stride loop over the live tiles, as the row gathers use, took 0.118 with or
without expert parallelism).
Launched through ``wrap_triton`` (the ops calling them are ``triton_op``s)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from plait.kernels._triton.permute import row_limit
from torch.library import wrap_triton


@triton.jit
def _swiglu_fwd(
    a_ptr, b_ptr, w_ptr, n_ptr, y_ptr, n_rows, n_cols, in_stride, up_offset,
    HAS_W: tl.constexpr, HAS_N: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # gate at a_ptr, up at b_ptr (the same tensor up_offset columns on when fused): base pointers, no
    # views, so that torch.compile sees each tensor once (a view of a mutated output is cloned).
    limit = row_limit(n_ptr, n_rows, HAS_N)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    tile = tl.program_id(0)
    if tile * ROWS < limit:  # a tile wholly past the bound does nothing
        rows = tl.arange(0, ROWS).to(tl.int64) + tile * ROWS
        live = rows < limit
        mask = live[:, None] & (cols < n_cols)[None, :]
        at = rows[:, None] * in_stride + cols[None, :]
        g = tl.load(a_ptr + at, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(b_ptr + at + up_offset, mask=mask, other=0.0).to(tl.float32)
        y = g * tl.sigmoid(g) * u
        if HAS_W:
            y = y * tl.load(w_ptr + rows, mask=live, other=0.0).to(tl.float32)[:, None]
        tl.store(y_ptr + rows[:, None] * n_cols + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd(
    dy_ptr, a_ptr, b_ptr, w_ptr, n_ptr, da_ptr, db_ptr, dwp_ptr, n_rows, n_cols, in_stride, up_offset,
    n_col_blocks, FUSED: tl.constexpr, HAS_W: tl.constexpr, NEED_DW: tl.constexpr, HAS_N: tl.constexpr,
    ROWS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    limit = row_limit(n_ptr, n_rows, HAS_N)
    cb = tl.program_id(1)
    cols = cb * BLOCK + tl.arange(0, BLOCK)
    tile = tl.program_id(0)
    if tile * ROWS < limit:  # a tile wholly past the bound does nothing
        rows = tl.arange(0, ROWS).to(tl.int64) + tile * ROWS
        live = rows < limit
        mask = live[:, None] & (cols < n_cols)[None, :]
        at = rows[:, None] * in_stride + cols[None, :]
        dy = tl.load(dy_ptr + rows[:, None] * n_cols + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        g = tl.load(a_ptr + at, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(b_ptr + at + up_offset, mask=mask, other=0.0).to(tl.float32)
        s = tl.sigmoid(g)
        silu = g * s
        if NEED_DW:
            # d row_weight = sum_cols dy * silu * up; one partial per column block, summed by torch.
            tl.store(dwp_ptr + rows * n_col_blocks + cb, tl.sum(dy * silu * u, axis=1), mask=live)
        if HAS_W:
            dy = dy * tl.load(w_ptr + rows, mask=live, other=0.0).to(tl.float32)[:, None]
        dg = dy * u * s * (1.0 + g * (1.0 - s))
        du = dy * silu
        tl.store(da_ptr + at, dg.to(da_ptr.dtype.element_ty), mask=mask)
        if FUSED:  # both halves into the one [rows, 2I] gradient
            tl.store(da_ptr + at + up_offset, du.to(da_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(db_ptr + at, du.to(db_ptr.dtype.element_ty), mask=mask)


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
    b = b.contiguous() if b is not None else None
    cols = a.shape[-1] // 2 if b is None else a.shape[-1]
    rows = a.numel() // a.shape[-1] if a.shape[-1] else 0
    y = torch.empty((*a.shape[:-1], cols), dtype=a.dtype, device=a.device)
    wf = w.contiguous() if w is not None else None
    block = _block(cols)
    per = _rows(block, 4096)
    if rows and cols:
        wrap_triton(_swiglu_fwd)[(triton.cdiv(rows, per), triton.cdiv(cols, block))](
            a, a if b is None else b, a if wf is None else wf, a if n is None else n, y, rows, cols,
            a.shape[-1], cols if b is None else 0,
            HAS_W=wf is not None, HAS_N=n is not None, ROWS=per, BLOCK=block, num_warps=_warps(block),
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
    a, dy = a.contiguous(), dy.contiguous()
    fused = b is None
    b = b.contiguous() if b is not None else None
    cols = a.shape[-1] // 2 if fused else a.shape[-1]
    rows = a.numel() // a.shape[-1] if a.shape[-1] else 0
    da = torch.empty_like(a)
    db = torch.empty_like(b) if b is not None else None
    wf = w.contiguous() if w is not None else None
    need_dw = need_dw and wf is not None
    # With the row-weight gradient, column blocks of 2048 on 4 warps and a torch sum of the partials
    # beat whole rows (on an H100 at 16384 x 8192: 0.468 against 0.502 ms, the sum included).
    block = min(_block(cols), 2048) if need_dw else _block(cols)
    warps = 4 if need_dw else _warps(block)
    per = _rows(block, 2048)
    ncb = triton.cdiv(cols, block) if cols else 1
    dwp = torch.empty((rows, ncb), dtype=torch.float32, device=a.device) if need_dw else None
    if rows and cols:
        # Pointers that a launch does not use get ``dy`` (never written): each mutated tensor is
        # passed once.
        wrap_triton(_swiglu_bwd)[(triton.cdiv(rows, per), ncb)](
            dy, a, a if b is None else b, dy if wf is None else wf, dy if n is None else n, da,
            dy if db is None else db, dy if dwp is None else dwp, rows, cols, a.shape[-1],
            cols if fused else 0, ncb,
            FUSED=fused, HAS_W=wf is not None, NEED_DW=need_dw, HAS_N=n is not None, ROWS=per,
            BLOCK=block, num_warps=warps,
        )  # fmt: skip
    dw = None
    if need_dw:
        assert dwp is not None and w is not None
        # one column block (I <= 2048): the partials are the sums, no reduction kernel
        dw = (dwp[:, 0] if ncb == 1 else dwp.sum(1)).view(w.shape).to(w.dtype)
    return da, db, dw
