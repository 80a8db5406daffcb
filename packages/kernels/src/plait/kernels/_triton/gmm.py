"""Triton grouped GEMM whose group sizes stay on the device (no host read: a CUDA graph captures it).

For every dtype and GPU the CUTLASS path of ``torch._grouped_mm`` does not take (float32, float16,
pre-Hopper GPUs, dims that are not multiples of 8). Both kernels take the weights by strides, so one
kernel serves ``w [E, K, N]`` and its transpose ``[E, N, K]``:

* :func:`grouped_mm`: ``out[rows of e] = a[rows of e] @ b_e``. The grid is sized by a static bound on
  the row tiles (``cdiv(M, BM) + E``: each group adds at most one partial tile); a program finds its
  group from the tile counts' prefix sums and returns at once past the last tile.
* :func:`grouped_weight_grad`: ``dw_e = x_e^T @ dy_e``, one program per (expert, output tile) looping
  over the group's rows; an empty group's gradient is zero.

Float32 operands multiply in TF32 exactly when torch's own float32 matmuls do
(``torch.get_float32_matmul_precision() != "highest"``), else in full float32; accumulation is float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton


@triton.jit
def _grouped_mm(
    a_ptr, b_ptr, out_ptr, tile_end_ptr, row_end_ptr, n_rows, n_out, n_in,
    s_be, s_bk, s_bn, n_groups,
    PRECISION: tl.constexpr, GROUPS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    n_tiles_n = tl.cdiv(n_out, BN)
    tile = tl.program_id(0) // n_tiles_n
    pid_n = tl.program_id(0) % n_tiles_n
    groups = tl.arange(0, GROUPS)
    tile_end = tl.load(tile_end_ptr + groups, mask=groups < n_groups, other=2**31 - 1)
    if tile < tl.load(tile_end_ptr + n_groups - 1):
        e = tl.sum((tile_end <= tile).to(tl.int32), axis=0)  # the group whose tiles hold this one
        first_tile = tl.load(tile_end_ptr + e - 1, mask=e > 0, other=0)
        start = tl.load(row_end_ptr + e - 1, mask=e > 0, other=0)
        end = tl.minimum(tl.load(row_end_ptr + e), n_rows)
        rows = (start + (tile - first_tile) * BM + tl.arange(0, BM)).to(tl.int64)
        cols = pid_n * BN + tl.arange(0, BN)
        ks = tl.arange(0, BK)
        b_base = b_ptr + e.to(tl.int64) * s_be
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k in range(0, n_in, BK):
            kk = k + ks
            a = tl.load(
                a_ptr + rows[:, None] * n_in + kk[None, :],
                mask=(rows[:, None] < end) & (kk[None, :] < n_in),
                other=0.0,
            )
            b = tl.load(
                b_base + kk[:, None] * s_bk + cols[None, :] * s_bn,
                mask=(kk[:, None] < n_in) & (cols[None, :] < n_out),
                other=0.0,
            )
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
        tl.store(
            out_ptr + rows[:, None] * n_out + cols[None, :],
            acc.to(out_ptr.dtype.element_ty),
            mask=(rows[:, None] < end) & (cols[None, :] < n_out),
        )


@triton.jit
def _grouped_weight_grad(
    x_ptr, dy_ptr, dw_ptr, row_end_ptr, n_rows, k_dim, n_dim, s_xm, s_xk, s_dm, s_dn, s_we, s_wk, s_wn,
    PRECISION: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr,
):  # fmt: skip
    e = tl.program_id(0)
    n_tiles_n = tl.cdiv(n_dim, BN)
    pid_k = tl.program_id(1) // n_tiles_n
    pid_n = tl.program_id(1) % n_tiles_n
    start = tl.load(row_end_ptr + e - 1, mask=e > 0, other=0)
    end = tl.minimum(tl.load(row_end_ptr + e), n_rows)
    ks = pid_k * BK + tl.arange(0, BK)
    ns = pid_n * BN + tl.arange(0, BN)
    acc = tl.zeros((BK, BN), dtype=tl.float32)
    for m in range(start, end, BM):
        rows = (m + tl.arange(0, BM)).to(tl.int64)
        xt = tl.load(
            x_ptr + rows[None, :] * s_xm + ks[:, None] * s_xk,
            mask=(rows[None, :] < end) & (ks[:, None] < k_dim),
            other=0.0,
        )
        dy = tl.load(
            dy_ptr + rows[:, None] * s_dm + ns[None, :] * s_dn,
            mask=(rows[:, None] < end) & (ns[None, :] < n_dim),
            other=0.0,
        )
        acc = tl.dot(xt, dy, acc, input_precision=PRECISION)
    tl.store(
        dw_ptr + e.to(tl.int64) * s_we + ks[:, None] * s_wk + ns[None, :] * s_wn,
        acc.to(dw_ptr.dtype.element_ty),
        mask=(ks[:, None] < k_dim) & (ns[None, :] < n_dim),
    )


def _precision(dtype: torch.dtype) -> str:
    if dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest":
        return "ieee"
    return "tf32"


def _ends(counts: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The groups' ends (inclusive prefix sums of their sizes), int32 on ``device``."""
    return torch.cumsum(counts.to(device=device, dtype=torch.int64), 0).to(torch.int32)


def _tiles(dtype: torch.dtype, precision: str, op: str) -> tuple[int, int, int, int, int]:
    """(BM, BN, BK, warps, stages), the fastest of sweeps on an H200 at 128 experts, K=2048, N=768 (BM is the
    rows' tile: the output's in the product, the reduction's in the weight gradient). ``op``: ``"mm_t"``
    (weights read transposed, ``[E, N, K]``: the reduction runs along their rows), ``"mm"`` (``[E, K, N]``)
    or ``"dw"`` (the weight gradient)."""
    if dtype.itemsize == 2:
        return (64, 128, 128, 8, 3) if op == "dw" else (128, 128, 64, 8, 3)
    if precision == "tf32":
        return {"dw": (32, 128, 32, 4, 3), "mm": (128, 64, 32, 4, 3)}.get(op, (64, 128, 32, 4, 3))
    return {"dw": (16, 64, 64, 4, 4), "mm_t": (64, 128, 16, 4, 4)}.get(op, (64, 128, 32, 4, 3))


def grouped_mm(
    a: torch.Tensor, b: torch.Tensor, tokens_per_expert: torch.Tensor, trans_b: bool
) -> torch.Tensor:
    """``[M, N]``: ``a [M, K]`` times ``b [E, K, N]`` (``[E, N, K]`` with ``trans_b``) per group of rows;
    rows past the groups are not written."""
    a = a.contiguous()
    m, k = a.shape
    e, n = b.shape[0], b.shape[1] if trans_b else b.shape[2]
    out = torch.empty((m, n), dtype=a.dtype, device=a.device)
    if not (m and n and e):
        return out
    precision = _precision(a.dtype)
    bm, bn, bk, warps, stages = _tiles(a.dtype, precision, "mm_t" if trans_b else "mm")
    tile_end = _ends((tokens_per_expert + bm - 1) // bm, a.device)
    row_end = _ends(tokens_per_expert, a.device)
    s_be, s_bk, s_bn = (b.stride(0), b.stride(2), b.stride(1)) if trans_b else b.stride()
    grid = ((triton.cdiv(m, bm) + e) * triton.cdiv(n, bn),)
    wrap_triton(_grouped_mm)[grid](
        a, b, out, tile_end, row_end, m, n, k, s_be, s_bk, s_bn, e,
        PRECISION=precision, GROUPS=max(16, triton.next_power_of_2(e)), BM=bm, BN=bn, BK=bk,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


def grouped_weight_grad(
    x: torch.Tensor, dy: torch.Tensor, tokens_per_expert: torch.Tensor, trans_w: bool
) -> torch.Tensor:
    """``dw [E, K, N]`` (``[E, N, K]`` with ``trans_w``): ``x_e^T @ dy_e`` per group, zero for empty ones."""
    x, dy = x.contiguous(), dy.contiguous()
    e, k, n = tokens_per_expert.shape[0], x.shape[1], dy.shape[1]
    dw = torch.empty((e, n, k) if trans_w else (e, k, n), dtype=x.dtype, device=x.device)
    if not (e and k and n):
        return dw
    precision = _precision(x.dtype)
    bm, bn, bk, warps, stages = _tiles(x.dtype, precision, "dw")
    row_end = _ends(tokens_per_expert, x.device)
    s_we, s_wk, s_wn = (dw.stride(0), dw.stride(2), dw.stride(1)) if trans_w else dw.stride()
    wrap_triton(_grouped_weight_grad)[(e, triton.cdiv(k, bk) * triton.cdiv(n, bn))](
        x, dy, dw, row_end, x.shape[0], k, n, *x.stride(), *dy.stride(), s_we, s_wk, s_wn,
        PRECISION=precision, BM=bm, BK=bk, BN=bn, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return dw
