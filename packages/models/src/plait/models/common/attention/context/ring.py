"""Ring context parallelism: K/V blocks travel around the group with point-to-point sends.

The transfer of the next block is posted before the current block is computed, so the two
overlap. Block results merge with the log-sum-exp rule; the backward recomputes each block's
probabilities from the saved log-sum-exp and sends the K/V gradients around the ring to their
owners. Chunk pairs that the causal mask hides entirely are skipped. The block kernel is plain
PyTorch (query tiles bound the score memory; fp32 softmax statistics; CUDA fp16/bf16 matmuls on
tensor cores with fp32 accumulation). The log-sum-exp is an output with a gradient, so attention
sinks apply outside (``out * sigmoid(lse - sink)``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from plait.models.common.attention.context.group import ContextParallelMask
from plait.models.common.attention.context.lse import merge_lse

__all__ = ["ring_attention"]

# Query rows per block of the ring's PyTorch kernel: bounds the [B, H, rows, chunk] score tensor.
_Q_TILE = 2048


def _exchange(send: torch.Tensor, recv: torch.Tensor, cp: ContextParallelMask, tag: int) -> list[Any]:
    """Post ``send`` to the next ring rank and ``recv`` from the previous one; returns the works."""
    ops = [
        dist.P2POp(dist.isend, send, cp.peer(1), cp.group, tag),
        dist.P2POp(dist.irecv, recv, cp.peer(-1), cp.group, tag),
    ]
    return list(dist.batch_isend_irecv(ops))


def _wait(works: list[Any]) -> None:
    for w in works:
        w.wait()


def _tiles(length: int) -> Iterator[slice]:
    for start in range(0, length, _Q_TILE):
        yield slice(start, min(start + _Q_TILE, length))


def _block_mask(cp: ContextParallelMask, q_chunk: int, kv_chunk: int, rows: slice) -> torch.Tensor | None:
    """Boolean ``[B|1, 1, rows, 1, chunk]`` (True = attend; the 1 is the GQA group) for one tile of
    a chunk pair, or None when everything is visible."""
    c = cp.chunk
    mask: torch.Tensor | None = None
    q_idx = torch.arange(rows.start, rows.stop, device=cp.q_positions.device)
    kv_idx = torch.arange(c, device=q_idx.device)
    if q_chunk == kv_chunk:
        mask = (q_idx[:, None] >= kv_idx[None, :])[None, None, :, None]
    if cp.sliding_window is not None:  # in global positions
        near = (q_chunk * c + q_idx[:, None]) - (kv_chunk * c + kv_idx[None, :]) < cp.sliding_window
        mask = near[None, None, :, None] if mask is None else mask & near[None, None, :, None]
    qd, kd = cp.chunk_docs(q_chunk), cp.chunk_docs(kv_chunk)
    if qd is not None and kd is not None:
        same = (qd[:, rows, None] == kd[:, None, :])[:, None, :, None]
        mask = same if mask is None else mask & same
    return mask


def _visible_pairs(cp: ContextParallelMask, kv_rank: int) -> Iterator[tuple[int, int, int, int]]:
    """``(q_slot, q_chunk, kv_slot, kv_chunk)`` of the chunk pairs the causal mask does not hide.

    Slots are the positions (0 or 1) of the chunks in the local / the travelling shard; the
    diagonal pair comes before the other one of the same query chunk, so a query row's first
    block always has a visible key (itself).
    """
    for q_slot, q_chunk in enumerate(cp.chunks_of(cp.rank)):
        pairs = [(kv_slot, kc) for kv_slot, kc in enumerate(cp.chunks_of(kv_rank)) if q_chunk >= kc]
        for kv_slot, kv_chunk in sorted(pairs, key=lambda p: p[1] != q_chunk):
            yield q_slot, q_chunk, kv_slot, kv_chunk


@dataclass(frozen=True)
class _Kernel:
    """Precision of the ring's block kernel.

    ``half`` (CUDA fp16/bf16 inputs): matmul operands in that dtype, fp32 accumulation and output
    (tensor cores; probabilities and score gradients are rounded to it before their matmuls, as
    FlashAttention does). Otherwise operands and results in ``acc`` (fp32, or fp64 for fp64 inputs).
    """

    acc: torch.dtype
    half: torch.dtype | None
    scale: float

    @staticmethod
    def for_input(x: torch.Tensor, scale: float) -> _Kernel:
        half = x.dtype if x.is_cuda and x.dtype in (torch.float16, torch.bfloat16) else None
        return _Kernel(torch.promote_types(x.dtype, torch.float32), half, scale)

    def matmul(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``a [B, H, m, k] @ b [B, H, k, n]`` in the ``acc`` dtype."""
        if self.half is None:
            return torch.matmul(a.to(self.acc), b.to(self.acc))
        a3 = a.to(self.half).reshape(-1, *a.shape[-2:])
        b3 = b.to(self.half).reshape(-1, *b.shape[-2:])
        return torch.bmm(a3, b3, out_dtype=torch.float32).view(*a.shape[:-1], b.shape[-1])

    def scores(self, q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Masked scores ``[B, Hk, r*G, c]`` of query rows ``q [B, Hk, r*G, D]`` (row-major over
        (token, group)) against ``k [B, Hk, c, D]``; ``mask`` ``[B|1, 1, r, 1, c]``."""
        s = self.matmul(q, k.transpose(-1, -2)) * self.scale
        if mask is None:
            return s
        b, h, rows, c = s.shape
        s5 = s.view(b, h, mask.shape[2], rows // mask.shape[2], c).masked_fill(~mask, float("-inf"))
        return s5.view(b, h, rows, c)


def _block_forward(
    kern: _Kernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One block: (normalised out ``[B, Hk, rows, D]``, log-sum-exp ``[B, Hk, rows]``)."""
    s = kern.scores(q, k, mask)
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # rows that see no key here
    p = torch.exp(s - m)
    denom = p.sum(dim=-1, keepdim=True)
    out = kern.matmul(p, v) / torch.where(denom == 0, torch.ones_like(denom), denom)
    return out, (m + torch.log(denom)).squeeze(-1)


def _rows(x: torch.Tensor, hk: int) -> torch.Tensor:
    """``[B, S, Hq, D]`` -> ``[B, Hk, S, G, D]`` (contiguous): a tile of tokens is a view of rows."""
    b, s, hq, d = x.shape
    return x.view(b, s, hk, hq // hk, d).permute(0, 2, 1, 3, 4).contiguous()


def _unrows(x: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`_rows`."""
    b, hk, s, g, d = x.shape
    return x.permute(0, 2, 1, 3, 4).reshape(b, s, hk * g, d)


class _RingAttention(torch.autograd.Function):
    """Ring attention over ``cp.group``; tensors ``[B, S, H, D]`` in, ``[B, S, Hq, D]`` out."""

    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: ContextParallelMask, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        b, _, hk, d = k.shape
        kern = _Kernel.for_input(q, scale)
        c = cp.chunk
        qr = _rows(q, hk)  # [B, Hk, S, G, D]
        g = qr.shape[3]
        kv = torch.stack([k, v]).permute(0, 1, 3, 2, 4).contiguous()  # [2, B, Hk, S, D]
        out = torch.zeros(qr.shape, dtype=kern.acc, device=q.device)
        lse = torch.full(qr.shape[:-1], float("-inf"), dtype=kern.acc, device=q.device)
        for step in range(cp.size):
            works: list[Any] = []
            if step < cp.size - 1:
                incoming = torch.empty_like(kv)
                works = _exchange(kv, incoming, cp, tag=0)
            kv_rank = (cp.rank - step) % cp.size
            for q_slot, q_chunk, kv_slot, kv_chunk in _visible_pairs(cp, kv_rank):
                ks = slice(kv_slot * c, (kv_slot + 1) * c)
                for rows in _tiles(c):
                    sl = slice(q_slot * c + rows.start, q_slot * c + rows.stop)
                    n_rows = (rows.stop - rows.start) * g
                    mask = _block_mask(cp, q_chunk, kv_chunk, rows)
                    o_b, l_b = _block_forward(
                        kern, qr[:, :, sl].reshape(b, hk, n_rows, d), kv[0, :, :, ks], kv[1, :, :, ks], mask
                    )
                    o, lse_t = merge_lse(
                        out[:, :, sl].reshape(b, hk, n_rows, d),
                        lse[:, :, sl].reshape(b, hk, n_rows),
                        o_b,
                        l_b,
                    )
                    out[:, :, sl] = o.view(b, hk, -1, g, d)
                    lse[:, :, sl] = lse_t.view(b, hk, -1, g)
            _wait(works)
            if works:
                kv = incoming
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cp, ctx.kern = cp, kern
        # lse [B, Hk, S, G] -> [B, Hq, S] (query head = kv head x G + group index, as in _rows)
        return _unrows(out).to(q.dtype), lse.permute(0, 1, 3, 2).reshape(b, -1, lse.shape[2])

    @staticmethod
    def backward(
        ctx: Any, grad_out: torch.Tensor, grad_lse: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None, None]:
        q, k, v, out, lse = ctx.saved_tensors
        cp: ContextParallelMask = ctx.cp
        kern: _Kernel = ctx.kern
        b, _, hk, d = k.shape
        c = cp.chunk
        qr = _rows(q, hk)
        g = qr.shape[3]
        do = _rows(grad_out, hk)
        delta = (do.to(kern.acc) * out).sum(dim=-1)  # rowsum(dO * O) of the softmax backward
        if grad_lse is not None:  # d lse / d s = p: the same rows' term as -delta
            delta = delta - grad_lse.view(b, hk, g, -1).permute(0, 1, 3, 2).to(kern.acc)
        dq = torch.zeros(qr.shape, dtype=kern.acc, device=q.device)
        kv = torch.stack([k, v]).permute(0, 1, 3, 2, 4).contiguous()
        dkv: torch.Tensor | None = None  # gradient of the block held now, accumulated along the ring
        grad_works: list[Any] = []
        sending: torch.Tensor | None = None  # kept alive until its send completes
        for step in range(cp.size):
            works: list[Any] = []
            if step < cp.size - 1:
                incoming = torch.empty_like(kv)
                works = _exchange(kv, incoming, cp, tag=0)
            kv_rank = (cp.rank - step) % cp.size
            own = torch.zeros(kv.shape, dtype=kern.acc, device=kv.device)  # this rank's contribution
            for q_slot, q_chunk, kv_slot, kv_chunk in _visible_pairs(cp, kv_rank):
                ks = slice(kv_slot * c, (kv_slot + 1) * c)
                kk, vv = kv[0, :, :, ks], kv[1, :, :, ks]
                for rows in _tiles(c):
                    sl = slice(q_slot * c + rows.start, q_slot * c + rows.stop)
                    n_rows = (rows.stop - rows.start) * g
                    qq, dd = qr[:, :, sl].reshape(b, hk, n_rows, d), do[:, :, sl].reshape(b, hk, n_rows, d)
                    mask = _block_mask(cp, q_chunk, kv_chunk, rows)
                    p = torch.exp(kern.scores(qq, kk, mask) - lse[:, :, sl].reshape(b, hk, n_rows)[..., None])
                    own[1, :, :, ks] += kern.matmul(p.transpose(-1, -2), dd)
                    ds = p * (
                        kern.matmul(dd, vv.transpose(-1, -2))
                        - delta[:, :, sl].reshape(b, hk, n_rows)[..., None]
                    )
                    dq[:, :, sl] += (kern.matmul(ds, kk) * kern.scale).view(b, hk, -1, g, d)
                    own[0, :, :, ks] += kern.matmul(ds.transpose(-1, -2), qq) * kern.scale
            _wait(grad_works)
            sending = own if dkv is None else dkv + own
            # Pass the accumulated gradient on with its block; the next step's compute overlaps it.
            arriving = torch.empty_like(sending)
            grad_works = _exchange(sending, arriving, cp, tag=1)
            _wait(works)
            if works:
                kv = incoming
            # After the last step the gradient that arrives is that of this rank's own block.
            dkv = arriving
        _wait(grad_works)
        del sending
        assert dkv is not None
        dkv = dkv.permute(0, 1, 3, 2, 4)
        return _unrows(dq).to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None


def ring_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: ContextParallelMask, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ring attention of local ``q [B, S, Hq, D]`` to the whole sequence's ``k, v [B, S, Hk, D]``.

    Returns:
        ``(out [B, S, Hq, D], lse [B, Hq, S])`` (fp32 log-sum-exp, differentiable).
    """
    out, lse = _RingAttention.apply(q, k, v, cp, scale)
    return out, lse
