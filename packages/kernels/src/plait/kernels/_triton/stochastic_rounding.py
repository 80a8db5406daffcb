"""Triton stochastic rounding and fused stochastic-rounding AdamW step (Philox random bits)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _sr_bf16(x, r):
    # x fp32, r uint32 random: add 16 random bits below the bf16 mantissa, truncate.
    i = x.to(tl.int32, bitcast=True)
    i = (i + (r & 0xFFFF).to(tl.int32)) & -65536
    return i.to(tl.float32, bitcast=True).to(tl.bfloat16)  # exact: low bits are zero


@triton.jit
def _rand_block(seed, pid, BLOCK: tl.constexpr):
    # One Philox call yields four 32-bit words: spread them over four elements, so the random
    # arithmetic stays under the memory time (7 rounds: Philox4x32-7 is Crush-resistant).
    q = pid * (BLOCK // 4) + tl.arange(0, BLOCK // 4)
    r0, r1, r2, r3 = tl.randint4x(seed, q, n_rounds=7)
    return tl.reshape(tl.join(tl.join(r0, r1), tl.join(r2, r3)), (BLOCK,))


@triton.jit
def _sr_kernel(x_ptr, y_ptr, n, seed, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    r = _rand_block(seed, tl.program_id(0), BLOCK)
    tl.store(y_ptr + offs, _sr_bf16(x, r), mask=mask)


@triton.jit
def _adamw_kernel(
    p_ptr, g_ptr, m_ptr, v_ptr, scale_ptr, n, lr, b1, b2, eps, wd, bc1, bc2, seed,
    P_BF16: tl.constexpr, M_BF16: tl.constexpr, SCALED: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if SCALED:  # gradient clipping's factor, read on the device
        g = g * tl.load(scale_ptr).to(tl.float32)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    m = b1 * m + (1.0 - b1) * g
    v = b2 * v + (1.0 - b2) * g * g
    p = p * (1.0 - lr * wd)
    p = p - lr * (m / bc1) / (tl.sqrt(v / bc2) + eps)
    if P_BF16 or M_BF16:
        r = _rand_block(seed, tl.program_id(0), BLOCK)  # low half -> p, high half -> m
    if M_BF16:
        r_v = _rand_block(seed ^ 0x5BD1E995, tl.program_id(0), BLOCK)
    if P_BF16:
        tl.store(p_ptr + offs, _sr_bf16(p, r), mask=mask)
    else:
        tl.store(p_ptr + offs, p.to(p_ptr.dtype.element_ty), mask=mask)
    if M_BF16:
        tl.store(m_ptr + offs, _sr_bf16(m, r >> 16), mask=mask)
        tl.store(v_ptr + offs, _sr_bf16(v, r_v), mask=mask)
    else:
        tl.store(m_ptr + offs, m, mask=mask)
        tl.store(v_ptr + offs, v, mask=mask)


_BLOCK = 2048


def stochastic_round_triton(x: torch.Tensor, seed: int) -> torch.Tensor:
    """fp32 contiguous ``x`` -> bf16 with stochastic rounding."""
    y = torch.empty(x.shape, dtype=torch.bfloat16, device=x.device)
    n = x.numel()
    if n:
        _sr_kernel[(triton.cdiv(n, _BLOCK),)](x, y, n, seed, BLOCK=_BLOCK, num_warps=8)
    return y


def adamw_triton(
    p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, *, lr: float, b1: float, b2: float,
    eps: float, wd: float, bc1: float, bc2: float, seed: int, grad_scale: torch.Tensor | None = None,
) -> None:  # fmt: skip
    """In-place fused AdamW step on contiguous tensors (``p`` any float, moments fp32/bf16); the
    gradient is multiplied by the 0-d ``grad_scale`` (on ``p``'s device) when given."""
    n = p.numel()
    if m.dtype not in (torch.float32, torch.bfloat16) or m.dtype != v.dtype:
        raise ValueError(f"StochasticAdamW: moment dtypes {m.dtype}/{v.dtype} unsupported")
    _adamw_kernel[(triton.cdiv(n, _BLOCK),)](
        p, g, m, v, g if grad_scale is None else grad_scale.to(p.device), n, lr, b1, b2, eps, wd, bc1, bc2, seed,
        P_BF16=p.dtype == torch.bfloat16, M_BF16=m.dtype == torch.bfloat16, SCALED=grad_scale is not None,
        BLOCK=_BLOCK, num_warps=8,
    )  # fmt: skip
