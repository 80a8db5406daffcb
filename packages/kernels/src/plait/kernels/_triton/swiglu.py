"""Triton SwiGLU forward/backward: one program per row block, fp32 math, silu recomputed in backward."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _swiglu_fwd(
    g_ptr, u_ptr, w_ptr, y_ptr, n_cols, in_stride, out_stride,
    HAS_W: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(g_ptr + row * in_stride + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * in_stride + cols, mask=mask, other=0.0).to(tl.float32)
    y = g * tl.sigmoid(g) * u
    if HAS_W:
        y = y * tl.load(w_ptr + row).to(tl.float32)
    tl.store(y_ptr + row * out_stride + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd(
    dy_ptr, g_ptr, u_ptr, w_ptr, dg_ptr, du_ptr, dwp_ptr, n_cols, in_stride, dy_stride, n_col_blocks,
    HAS_W: tl.constexpr, NEED_DW: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cb = tl.program_id(1)
    cols = cb * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    dy = tl.load(dy_ptr + row * dy_stride + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + row * in_stride + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * in_stride + cols, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    silu = g * s
    if NEED_DW:
        # d row_weight = sum_cols dy * silu * up; one partial per column block, summed by torch.
        tl.store(dwp_ptr + row * n_col_blocks + cb, tl.sum(dy * silu * u, axis=0))
    if HAS_W:
        dy = dy * tl.load(w_ptr + row).to(tl.float32)
    dg = dy * u * s * (1.0 + g * (1.0 - s))
    du = dy * silu
    tl.store(dg_ptr + row * in_stride + cols, dg.to(dg_ptr.dtype.element_ty), mask=mask)
    tl.store(du_ptr + row * in_stride + cols, du.to(du_ptr.dtype.element_ty), mask=mask)


def _block(n_cols: int) -> int:
    # Whole rows up to 8192 columns per program (fewer, longer programs stream better).
    return min(8192, triton.next_power_of_2(max(n_cols, 16)))


def _warps(block: int) -> int:
    return 16 if block >= 8192 else (8 if block >= 2048 else 4)


def swiglu_forward(a: torch.Tensor, b: torch.Tensor | None, w: torch.Tensor | None) -> torch.Tensor:
    """Triton SwiGLU; ``b is None`` means ``a`` is the fused ``[..., 2I]`` tensor."""
    a = a.contiguous()
    if b is None:
        n = a.shape[-1] // 2
        a2 = a.view(-1, 2 * n)
        gate, up = a2, a2[:, n:]
        in_stride = 2 * n
    else:
        b = b.contiguous()
        n = a.shape[-1]
        gate, up = a.view(-1, n), b.view(-1, n)
        in_stride = n
    rows = gate.shape[0]
    y = torch.empty((*a.shape[:-1], n), dtype=a.dtype, device=a.device)
    wf = w.contiguous().view(-1) if w is not None else None
    block = _block(n)
    if rows and n:
        _swiglu_fwd[(rows, triton.cdiv(n, block))](
            gate, up, wf if wf is not None else gate, y, n, in_stride, n,
            HAS_W=wf is not None, BLOCK=block, num_warps=_warps(block),
        )  # fmt: skip
    return y


def swiglu_backward(
    dy: torch.Tensor, a: torch.Tensor, b: torch.Tensor | None, w: torch.Tensor | None, need_dw: bool
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(da, db, dw)``: ``db`` is None when fused, ``dw`` None unless ``need_dw`` and ``w`` is given."""
    a = a.contiguous()
    fused = b is None
    n = a.shape[-1] // 2 if fused else a.shape[-1]
    dy = dy.contiguous().view(-1, n)
    dgb = None
    if b is None:
        a2 = a.view(-1, 2 * n)
        gate, up = a2, a2[:, n:]
        dga = torch.empty_like(a)
        d2 = dga.view(-1, 2 * n)
        dgate, dup = d2, d2[:, n:]
        in_stride = 2 * n
    else:
        b = b.contiguous()
        gate, up = a.view(-1, n), b.view(-1, n)
        dga, dgb = torch.empty_like(a), torch.empty_like(b)
        dgate, dup = dga.view(-1, n), dgb.view(-1, n)
        in_stride = n
    rows = gate.shape[0]
    wf = w.contiguous().view(-1) if w is not None else None
    need_dw = need_dw and wf is not None
    # With the row-weight gradient, column blocks of 2048 on 4 warps and a torch sum of the partials
    # beat whole rows (on an H100 at 16384 x 8192: 0.468 against 0.502 ms, the sum included).
    block = min(_block(n), 2048) if need_dw else _block(n)
    warps = 4 if need_dw else _warps(block)
    ncb = triton.cdiv(n, block) if n else 1
    dwp = torch.empty((rows, ncb), dtype=torch.float32, device=a.device) if need_dw else None
    if rows and n:
        _swiglu_bwd[(rows, ncb)](
            dy, gate, up, wf if wf is not None else gate, dgate, dup, dwp if dwp is not None else dy,
            n, in_stride, n, ncb,
            HAS_W=wf is not None, NEED_DW=need_dw, BLOCK=block, num_warps=warps,
        )  # fmt: skip
    dw = None
    if need_dw:
        assert dwp is not None and w is not None
        # one column block (I <= 2048): the partials are the sums, no reduction kernel
        dw = (dwp[:, 0] if ncb == 1 else dwp.sum(1)).view(w.shape).to(w.dtype)
    return dga, dgb, dw
