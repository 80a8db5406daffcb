"""Triton stochastic rounding and fused stochastic-rounding AdamW step (Philox random bits)."""

from __future__ import annotations

import itertools

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
    table_ptr, tensor_of_block_ptr, scale_ptr, lr, b1, b2, eps, wd, bc1, bc2,
    P_BF16: tl.constexpr, G_BF16: tl.constexpr, M_BF16: tl.constexpr, SCALED: tl.constexpr,
    ALIGNED: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # One program per BLOCK elements of one tensor: tensor_of_block says which, its table row
    # [p, g, m, v addresses, numel, seed, first block] where (the tensors of one launch are many).
    pid = tl.program_id(0)
    row = table_ptr + tl.load(tensor_of_block_ptr + pid).to(tl.int64) * 7
    p_ptr = tl.load(row).to(tl.pointer_type(tl.bfloat16 if P_BF16 else tl.float32))
    g_ptr = tl.load(row + 1).to(tl.pointer_type(tl.bfloat16 if G_BF16 else tl.float32))
    m_ptr = tl.load(row + 2).to(tl.pointer_type(tl.bfloat16 if M_BF16 else tl.float32))
    v_ptr = tl.load(row + 3).to(tl.pointer_type(tl.bfloat16 if M_BF16 else tl.float32))
    n = tl.load(row + 4)
    if ALIGNED:  # what the compiler cannot see through the table: 16-byte loads and stores
        p_ptr = tl.multiple_of(p_ptr, 16)
        g_ptr = tl.multiple_of(g_ptr, 16)
        m_ptr = tl.multiple_of(m_ptr, 16)
        v_ptr = tl.multiple_of(v_ptr, 16)
        n = tl.multiple_of(n, 16)
    seed = tl.load(row + 5).to(tl.int32)
    block = (pid - tl.load(row + 6)).to(tl.int32)  # the block's index inside its tensor
    offs = block.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
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
        r = _rand_block(seed, block, BLOCK)  # low half -> p, high half -> m
    if M_BF16:
        r_v = _rand_block(seed ^ 0x5BD1E995, block, BLOCK)
    if P_BF16:
        tl.store(p_ptr + offs, _sr_bf16(p, r), mask=mask)
    else:
        tl.store(p_ptr + offs, p, mask=mask)
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


_DTYPES = (torch.float32, torch.bfloat16)
_tensor_of_block: dict[tuple[torch.device, tuple[int, ...]], torch.Tensor] = {}  # by the launch's numels


def adamw_triton(
    tensors: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]], *, lr: float, b1: float,
    b2: float, eps: float, wd: float, bc1: float, bc2: float, grad_scale: torch.Tensor | None = None,
    wide: bool | None = None,
) -> None:  # fmt: skip
    """In-place fused AdamW step of many tensors in one launch: ``tensors`` holds ``(p, g, m, v, seed)``
    of contiguous tensors on one device, every ``p`` of one dtype, every ``g`` of one, every moment
    of one (fp32 or bf16 each). Each gradient is multiplied by the 0-d ``grad_scale`` when given.
    The random bits of a tensor depend on its seed and its elements' positions only, not on the
    other tensors of the launch. When every address is a multiple of 16 bytes and every numel of 16
    elements (``wide_access``; ``wide``: the caller has checked it, None: checked here), the kernel moves
    16 bytes per load and store; one other tensor in the launch makes the whole launch take narrow
    accesses (the optimizer launches such tensors apart)."""
    p0, g0, m0 = tensors[0][:3]
    if {p0.dtype, g0.dtype, m0.dtype} - set(_DTYPES) or any(
        (p.dtype, g.dtype, m.dtype, v.dtype) != (p0.dtype, g0.dtype, m0.dtype, m0.dtype) for p, g, m, v, _ in tensors
    ):  # fmt: skip
        raise ValueError("StochasticAdamW: one launch takes fp32/bf16 tensors, one dtype per role")
    numels = tuple(p.numel() for p, *_ in tensors)
    blocks = [triton.cdiv(n, _BLOCK) for n in numels]
    first = itertools.accumulate(blocks[:-1], initial=0)  # each tensor's first program
    key = (p0.device, numels)
    if (tensor_of_block := _tensor_of_block.get(key)) is None:
        counts = torch.tensor(blocks, device=p0.device)
        tensor_of_block = torch.repeat_interleave(
            torch.arange(len(blocks), device=p0.device, dtype=torch.int32), counts
        )
        _tensor_of_block[key] = tensor_of_block
    rows = [
        (p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), n, seed, f)
        for (p, g, m, v, seed), n, f in zip(tensors, numels, first)
    ]
    if wide is None:
        from plait.kernels.stochastic_rounding import wide_access

        wide = all(wide_access(p, g, m, v) for p, g, m, v, _ in tensors)
    table = torch.tensor(rows, dtype=torch.int64)
    if p0.is_cuda:
        table = table.pin_memory().to(p0.device, non_blocking=True)
    _adamw_kernel[(sum(blocks),)](
        table, tensor_of_block, p0 if grad_scale is None else grad_scale.to(p0.device), lr, b1, b2, eps, wd, bc1,
        bc2, P_BF16=p0.dtype == torch.bfloat16, G_BF16=g0.dtype == torch.bfloat16,
        M_BF16=m0.dtype == torch.bfloat16, SCALED=grad_scale is not None, ALIGNED=wide, BLOCK=_BLOCK,
        num_warps=8,
    )  # fmt: skip
