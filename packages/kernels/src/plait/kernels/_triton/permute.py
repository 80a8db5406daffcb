"""Triton row movement for MoE permute / unpermute: pure gathers, no atomics (deterministic).

Launched through ``wrap_triton``: the ops that call them are ``triton_op``s, traced by ``torch.compile``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton


@triton.jit
def row_limit(n_ptr, n_rows, HAS_N: tl.constexpr):
    """The rows a row-bounded kernel computes: all ``n_rows``, or the first ``*n_ptr`` of them (a row
    count on the device, e.g. ``RowIdMap.rows``)."""
    limit = n_rows
    if HAS_N:
        limit = tl.minimum(tl.load(n_ptr), n_rows)
    return limit


@triton.jit
def _gather_rows(
    x_ptr, src_ptr, w_ptr, n_ptr, out_ptr, n_rows, n_cols,
    HAS_W: tl.constexpr, HAS_N: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # Rows loop grid-stride up to the bound (rows at or past it are neither read nor written, and cost
    # no program: _programs).
    limit = row_limit(n_ptr, n_rows, HAS_N)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    for r in range(tl.program_id(0), limit, tl.num_programs(0)):
        row = r + tl.zeros((), tl.int64)  # int64 offsets (the interpreter's loop index is a Python int)
        s = tl.load(src_ptr + row)
        v = tl.load(x_ptr + s * n_cols + cols, mask=mask & ((cols * 0 + s) >= 0), other=0.0)
        if HAS_W:
            v = (v.to(tl.float32) * tl.load(w_ptr + row)).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * n_cols + cols, v, mask=mask)


@triton.jit
def _combine_rows(x_ptr, dst_ptr, w_ptr, out_ptr, n_cols, k, HAS_W: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in range(0, k):
        d = tl.load(dst_ptr + t * k + j)
        v = tl.load(x_ptr + d * n_cols + cols, mask=mask & ((cols * 0 + d) >= 0), other=0.0).to(tl.float32)
        if HAS_W:
            v = v * tl.load(w_ptr + t * k + j)
        acc += v
    tl.store(out_ptr + t * n_cols + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _row_dots(dy_ptr, x_ptr, dst_ptr, out_ptr, n_cols, k, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    d = tl.load(dst_ptr + t * k + j)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for c in range(0, n_cols, BLOCK):
        cols = c + tl.arange(0, BLOCK)
        mask = (cols < n_cols) & ((cols * 0 + d) >= 0)
        a = tl.load(dy_ptr + t * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(x_ptr + d * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        acc += a * b
    tl.store(out_ptr + t * k + j, tl.sum(acc, axis=0))


def _block(n: int) -> int:
    return min(2048, triton.next_power_of_2(max(n, 16)))


def _warps(block: int) -> int:
    return 8 if block >= 2048 else 4


def _programs(rows: int, device: torch.device, bounded: bool) -> int:
    """Programs of :func:`_gather_rows` (each loops grid-stride over its rows).

    One per row, unless a device-side bound (``bounded``) leaves some rows out: then at most 64 per SM,
    so that the rows past the bound cost no program. These one-row programs are bound by the GPU's
    block scheduling rather than by memory, and one that only checks the bound and returns costs about
    what a working one does: on an H200 the all-gather dispatch's two gathers (a buffer of twice the
    used rows) took 0.20 ms per layer and step with one program per row, 0.12 ms looping (0.10 for the
    used rows alone, without expert parallelism).
    """
    if not bounded:
        return rows
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    return max(1, min(rows, 64 * sms))


def gather_rows(
    x: torch.Tensor, src: torch.Tensor, w_rows: torch.Tensor | None, n: torch.Tensor | None = None
) -> torch.Tensor:
    """``out[m] = x[src[m]] * w_rows[m]`` (``0`` where ``src[m] < 0``) for ``m < n`` (a one-element
    integer tensor; every row without it); the rows at or past ``n`` are not written."""
    x, src = x.contiguous(), src.contiguous()
    w_rows = w_rows.contiguous() if w_rows is not None else None
    m, h = src.shape[0], x.shape[1]
    out = torch.empty((m, h), dtype=x.dtype, device=x.device)
    if m and h:
        b = _block(h)
        wrap_triton(_gather_rows)[(_programs(m, x.device, n is not None), triton.cdiv(h, b))](
            x,
            src,
            w_rows if w_rows is not None else x,
            n if n is not None else src,
            out,
            m,
            h,
            HAS_W=w_rows is not None,
            HAS_N=n is not None,
            BLOCK=b,
            num_warps=_warps(b),
        )
    return out


def combine_rows(x: torch.Tensor, dst: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor:
    """``out[t] = sum_j w[t, j] * x[dst[t, j]]`` over used slots, fp32 accumulation."""
    t, k = dst.shape
    h = x.shape[1]
    out = torch.empty((t, h), dtype=x.dtype, device=x.device)
    if t and h:
        b = _block(h)
        wc = w.contiguous() if w is not None else None
        wrap_triton(_combine_rows)[(t, triton.cdiv(h, b))](
            x, dst.contiguous(), wc if wc is not None else x, out, h, k,
            HAS_W=wc is not None, BLOCK=b, num_warps=_warps(b),
        )  # fmt: skip
    return out


def row_dots(dy: torch.Tensor, x: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """``out[t, j] = <dy[t], x[dst[t, j]]>`` in fp32 (0 for unused slots)."""
    t, k = dst.shape
    out = torch.zeros((t, k), dtype=torch.float32, device=dy.device)
    if t and k:
        b = _block(dy.shape[1])
        wrap_triton(_row_dots)[(t, k)](
            dy, x, dst.contiguous(), out, dy.shape[1], k, BLOCK=b, num_warps=_warps(b)
        )
    return out
