"""Context-parallel attention: the sequence is split over the ranks of a context group.

Every rank holds two chunks of each row in the load-balanced layout of
:mod:`plait.dist_core.context_parallel` (chunks ``i`` and ``2n-1-i`` of ``2n``). Projections,
q/k norms, RoPE (with global positions) and the MLP are per token and run on the local tokens;
only attention needs the other ranks' keys and values. Two ways, chosen by ``mode``:

- ``"allgather"`` (Llama 3): all-gather K and V over the group (differentiable; the backward
  reduce-scatters their gradients), then attend the local queries to the whole sequence with one
  SDPA (CPU) or FlexAttention (CUDA) call whose mask is causal in global positions and per
  document.
- ``"ring"``: K/V blocks travel around the group with point-to-point sends; the transfer of the
  next block is posted before the current block is computed, so the two overlap. Block results
  merge with the log-sum-exp rule; the backward recomputes each block's probabilities from the
  saved log-sum-exp and sends the K/V gradients around the ring to their owners. Chunk pairs that
  the causal mask hides entirely are skipped. The block kernel is plain PyTorch (fp32
  accumulation, query tiles bound the score memory).

Packed documents: document ids (given, or derived from position ids that restart) are
all-gathered once per forward, so a document that crosses chunk or rank boundaries is masked as
in the single-process model.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from plait.dist_core.context_parallel import gather_sequence, load_balanced_indices, unshard_sequence
from plait.models.blocks.attention import AttentionMask, _flex, document_ids_from_position_ids

__all__ = ["ContextParallel", "ContextParallelMask", "ContextParallelMode"]

ContextParallelMode = Literal["ring", "allgather"]

# Query rows per block of the ring's PyTorch kernel: bounds the [B, H, rows, chunk] score tensor.
_Q_TILE = 2048


@dataclass(frozen=True)
class ContextParallel:
    """The context group of a model and how its attention crosses ranks.

    Set by :func:`plait.models.parallelize` (``Qwen3Model.context_parallel``); a model holding one
    expects every ``[B, S]`` input in the load-balanced layout (see
    :func:`plait.dist_core.shard_batch`).

    Attributes:
        group: The context-parallel process group (the batch domain's ``cp`` dimension).
        mode: ``"allgather"`` or ``"ring"`` (see the module docs).
    """

    group: dist.ProcessGroup
    mode: ContextParallelMode = "allgather"

    @property
    def size(self) -> int:
        """Ranks in the context group."""
        return dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        """This rank's index in the context group."""
        return dist.get_rank(self.group)

    def local_positions(self, local_len: int, device: torch.device) -> torch.Tensor:
        """Global positions ``[local_len]`` of this rank's tokens (the default ``position_ids``)."""
        return load_balanced_indices(local_len * self.size, self.size, self.rank, device=device)

    def build_mask(
        self,
        batch: int,
        local_len: int,
        device: torch.device,
        *,
        document_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        implementation: str = "auto",
    ) -> AttentionMask:
        """The attention mask of one forward for this rank's shard (collective over the group).

        Args:
            batch: Batch size.
            local_len: Tokens per row on this rank.
            device: Device of the activations.
            document_ids: ``[B, local_len]`` sharded document ids.
            position_ids: ``[B or 1, local_len]`` sharded positions; restarts (in the full sequence)
                mark packed documents when no ``document_ids`` are given. None: no documents.
            implementation: ``auto``, ``sdpa`` or ``flex`` (the ``allgather`` kernel; ``auto`` is
                FlexAttention on CUDA, SDPA elsewhere). The ring has its own kernel.

        Raises:
            ValueError: ``flash`` or an unknown implementation, or shapes that do not match.
        """
        if implementation not in ("auto", "sdpa", "flex"):
            raise ValueError(
                f"attn_implementation={implementation!r} is not available with context parallelism; "
                "use auto, sdpa or flex"
            )
        n = self.size
        docs: torch.Tensor | None = None
        if document_ids is not None:
            if tuple(document_ids.shape) != (batch, local_len):
                raise ValueError(
                    f"document_ids must have shape {(batch, local_len)} (this rank's shard), "
                    f"got {tuple(document_ids.shape)}"
                )
            docs = gather_sequence(document_ids.to(device), self.group)
        elif position_ids is not None and local_len * n > 1:
            pos = gather_sequence(position_ids.to(device).expand(batch, local_len).contiguous(), self.group)
            if bool((pos[:, 1:] <= pos[:, :-1]).any()):
                docs = document_ids_from_position_ids(pos)
        q_pos = self.local_positions(local_len, device)
        cp = ContextParallelMask(self.group, self.mode, n, self.rank, local_len // 2, q_pos, docs)
        if self.mode == "ring":
            return AttentionMask("sdpa", context=cp)
        backend = (
            implementation if implementation != "auto" else ("flex" if device.type == "cuda" else "sdpa")
        )
        total = local_len * n
        if backend == "flex":
            from torch.nn.attention.flex_attention import create_block_mask

            q_docs = None if docs is None else docs[:, q_pos]

            def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
                causal = q_pos[q_idx] >= kv_idx
                if docs is None or q_docs is None:
                    return causal
                return causal & (q_docs[b, q_idx] == docs[b, kv_idx])

            block = create_block_mask(mask_mod, batch, None, local_len, total, device=device)
            return AttentionMask("flex", block_mask=block, context=cp)
        kv_pos = torch.arange(total, device=device)
        dense = (q_pos[:, None] >= kv_pos[None, :]).expand(batch, local_len, total)
        if docs is not None:
            dense = dense & (docs[:, q_pos, None] == docs[:, None, :])
        return AttentionMask("sdpa", dense_mask=dense[:, None], context=cp)


@dataclass(frozen=True)
class ContextParallelMask:
    """What one forward's context-parallel attention needs (built by :meth:`ContextParallel.build_mask`).

    Attributes:
        group: The context group.
        mode: ``"allgather"`` or ``"ring"``.
        size: Ranks in the group.
        rank: This rank's index.
        chunk: Tokens per chunk (``local_len // 2``).
        q_positions: ``[local_len]`` global positions of the local tokens.
        document_ids: ``[B, T]`` document ids of the full sequence, or None (plain causal).
    """

    group: dist.ProcessGroup
    mode: ContextParallelMode
    size: int
    rank: int
    chunk: int
    q_positions: torch.Tensor
    document_ids: torch.Tensor | None

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask, scale: float
    ) -> torch.Tensor:
        """Attention of local ``q [B, S, Hq, D]`` to the whole sequence's ``k, v [B, S, Hkv, D]``.

        Returns ``[B, S, Hq, D]``.
        """
        if self.mode == "ring":
            return _RingAttention.apply(q, k, v, self, scale)  # type: ignore[no-any-return]
        kv = _AllGather.apply(torch.stack([k, v]), self.group)
        kv = unshard_sequence(list(kv.unbind(0)), dim=2)
        qt, kt, vt = q.transpose(1, 2), kv[0].transpose(1, 2), kv[1].transpose(1, 2)
        if mask.backend == "flex":
            out = _flex(qt, kt, vt, mask.block_mask, scale)
        else:
            gqa = qt.shape[1] != kt.shape[1]
            out = F.scaled_dot_product_attention(
                qt, kt, vt, attn_mask=mask.dense_mask, scale=scale, enable_gqa=gqa
            )
        return out.transpose(1, 2)

    # -- ring helpers ----------------------------------------------------------------------------
    def chunks_of(self, rank: int) -> tuple[int, int]:
        """The two chunk indices (of ``2 * size``) held by context rank ``rank``."""
        return rank, 2 * self.size - 1 - rank

    def peer(self, offset: int) -> int:
        """Global rank of the context rank ``offset`` steps ahead on the ring."""
        return dist.get_global_rank(self.group, (self.rank + offset) % self.size)

    def chunk_docs(self, chunk: int) -> torch.Tensor | None:
        """``[B, chunk]`` document ids of global chunk ``chunk`` (None without documents)."""
        if self.document_ids is None:
            return None
        return self.document_ids[:, chunk * self.chunk : (chunk + 1) * self.chunk]


class _AllGather(torch.autograd.Function):
    """All-gather along a new leading dim ``[n, *x.shape]``; the backward reduce-scatters (sums)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        n = dist.get_world_size(group)
        out = x.new_empty((n * x.shape[0], *x.shape[1:]))
        dist.all_gather_into_tensor(out, x.contiguous(), group=group)
        return out.view(n, *x.shape)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        out = grad.new_empty(grad.shape[1:])
        dist.reduce_scatter_tensor(out, grad.reshape(-1, *grad.shape[2:]).contiguous(), group=ctx.group)
        return out, None


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
    """Boolean ``[B|1, 1, 1, rows, chunk]`` (True = attend) for one tile of a chunk pair, or None."""
    c = cp.chunk
    mask: torch.Tensor | None = None
    q_idx = torch.arange(rows.start, rows.stop, device=cp.q_positions.device)
    if q_chunk == kv_chunk:
        mask = (q_idx[:, None] >= torch.arange(c, device=q_idx.device)[None, :])[None, None, None]
    qd, kd = cp.chunk_docs(q_chunk), cp.chunk_docs(kv_chunk)
    if qd is not None and kd is not None:
        same = (qd[:, rows, None] == kd[:, None, :])[:, None, None]
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


def _block_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [B, Hk, G, r, D]``, ``k, v [B, Hk, 1, c, D]`` -> (normalised out, log-sum-exp ``[..., r]``)."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # rows that see no key here
    p = torch.exp(s - m)
    denom = p.sum(dim=-1, keepdim=True)
    out = torch.matmul(p, v) / torch.where(denom == 0, torch.ones_like(denom), denom)
    return out, (m + torch.log(denom)).squeeze(-1)


def _merge(
    out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two partial softmax results by the log-sum-exp rule (rows with no keys stay 0)."""
    new = torch.logaddexp(lse, block_lse)
    ref = torch.where(torch.isinf(new), torch.zeros_like(new), new)
    out = out * torch.exp(lse - ref)[..., None] + block_out * torch.exp(block_lse - ref)[..., None]
    return out, new


class _RingAttention(torch.autograd.Function):
    """Ring attention over ``cp.group``; tensors ``[B, S, H, D]`` in, ``[B, S, Hq, D]`` out."""

    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: ContextParallelMask, scale: float
    ) -> torch.Tensor:
        b, s, hq, d = q.shape
        hk = k.shape[2]
        acc = torch.promote_types(q.dtype, torch.float32)
        c = cp.chunk
        q5 = q.permute(0, 2, 1, 3).reshape(b, hk, hq // hk, s, d).to(acc)
        kv = torch.stack([k, v]).permute(0, 1, 3, 2, 4).contiguous()  # [2, B, Hk, S, D]
        out = q5.new_zeros(q5.shape)
        lse = q5.new_full(q5.shape[:-1], float("-inf"))
        for step in range(cp.size):
            works: list[Any] = []
            if step < cp.size - 1:
                incoming = torch.empty_like(kv)
                works = _exchange(kv, incoming, cp, tag=0)
            kv_rank = (cp.rank - step) % cp.size
            kv_acc = kv.to(acc)[:, :, :, None]  # [2, B, Hk, 1, S, D]
            for q_slot, q_chunk, kv_slot, kv_chunk in _visible_pairs(cp, kv_rank):
                kk = kv_acc[0, ..., kv_slot * c : (kv_slot + 1) * c, :]
                vv = kv_acc[1, ..., kv_slot * c : (kv_slot + 1) * c, :]
                for rows in _tiles(c):
                    sl = slice(q_slot * c + rows.start, q_slot * c + rows.stop)
                    mask = _block_mask(cp, q_chunk, kv_chunk, rows)
                    o_b, l_b = _block_forward(q5[..., sl, :], kk, vv, mask, scale)
                    out[..., sl, :], lse[..., sl] = _merge(out[..., sl, :], lse[..., sl], o_b, l_b)
            _wait(works)
            if works:
                kv = incoming
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cp, ctx.scale = cp, scale
        return out.reshape(b, hq, s, d).permute(0, 2, 1, 3).to(q.dtype)

    @staticmethod
    def backward(
        ctx: Any, grad_out: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None, None]:
        q, k, v, out, lse = ctx.saved_tensors
        cp: ContextParallelMask = ctx.cp
        scale: float = ctx.scale
        b, s, hq, d = q.shape
        hk = k.shape[2]
        acc = out.dtype
        c = cp.chunk
        q5 = q.permute(0, 2, 1, 3).reshape(b, hk, hq // hk, s, d).to(acc)
        do = grad_out.permute(0, 2, 1, 3).reshape(b, hk, hq // hk, s, d).to(acc)
        delta = (do * out).sum(dim=-1)  # rowsum(dO * O) of the softmax backward
        dq = torch.zeros_like(q5)
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
            kv_acc = kv.to(acc)[:, :, :, None]
            own = torch.zeros(kv_acc.shape, dtype=acc, device=kv.device)  # this rank's contribution
            for q_slot, q_chunk, kv_slot, kv_chunk in _visible_pairs(cp, kv_rank):
                ks = slice(kv_slot * c, (kv_slot + 1) * c)
                kk, vv = kv_acc[0, ..., ks, :], kv_acc[1, ..., ks, :]
                for rows in _tiles(c):
                    sl = slice(q_slot * c + rows.start, q_slot * c + rows.stop)
                    qq, dd = q5[..., sl, :], do[..., sl, :]
                    sc = torch.matmul(qq, kk.transpose(-1, -2)) * scale
                    mask = _block_mask(cp, q_chunk, kv_chunk, rows)
                    if mask is not None:
                        sc = sc.masked_fill(~mask, float("-inf"))
                    p = torch.exp(sc - lse[..., sl, None])
                    own[1, ..., ks, :] += torch.matmul(p.transpose(-1, -2), dd).sum(dim=2, keepdim=True)
                    ds = p * (torch.matmul(dd, vv.transpose(-1, -2)) - delta[..., sl, None])
                    dq[..., sl, :] += torch.matmul(ds, kk) * scale
                    own[0, ..., ks, :] += (
                        torch.matmul(ds.transpose(-1, -2), qq).sum(dim=2, keepdim=True) * scale
                    )
            own = own.squeeze(3)
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
        dq_out = dq.reshape(b, hq, s, d).permute(0, 2, 1, 3).to(q.dtype)
        dkv = dkv.permute(0, 1, 3, 2, 4)
        return dq_out, dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None
