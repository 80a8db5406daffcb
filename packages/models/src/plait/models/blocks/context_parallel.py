"""Context-parallel attention: the sequence is split over the ranks of a context group.

Every rank holds two chunks of each row in the load-balanced layout of
:mod:`plait.dist_core.context_parallel` (chunks ``i`` and ``2n-1-i`` of ``2n``). Projections,
q/k norms, RoPE (with global positions) and the MLP are per token and run on the local tokens;
only attention needs the other ranks' keys and values. Two ways, chosen by ``mode``:

- ``"allgather"`` (Llama 3): all-gather K and V over the group (differentiable; the backward
  reduce-scatters their gradients), then attend the local queries to the whole sequence. Plain
  causal rows (no documents, no padding) run SDPA kernels per local chunk: the chunk against its
  own keys (causal) and against the keys before it (no mask), merged by the log-sum-exp rule
  (cuDNN on Hopper+ GPUs for fp16/bf16, FlashAttention-for-CPU on CPU); otherwise one
  FlexAttention (CUDA) or dense-mask SDPA (CPU) call whose mask is causal in global positions and
  per document.
- ``"ring"``: K/V blocks travel around the group with point-to-point sends; the transfer of the
  next block is posted before the current block is computed, so the two overlap. Block results
  merge with the log-sum-exp rule; the backward recomputes each block's probabilities from the
  saved log-sum-exp and sends the K/V gradients around the ring to their owners. Chunk pairs that
  the causal mask hides entirely are skipped. The block kernel is plain PyTorch (query tiles
  bound the score memory; fp32 softmax statistics; CUDA fp16/bf16 matmuls on tensor cores with
  fp32 accumulation).

Packed documents: document ids (given, or derived from position ids that restart) are
all-gathered once per forward, so a document that crosses chunk or rank boundaries is masked as
in the single-process model. Padding (``attention_mask``) is all-gathered the same way and every
padding token of the full row becomes a one-token document, as in the single-process mask.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from plait.dist_core.context_parallel import gather_sequence, load_balanced_indices, unshard_sequence
from plait.models.blocks.attention import (
    AttentionMask,
    _flex,
    _isolate_padding,
    _padding_mask,
    document_ids_from_position_ids,
    flex_block_mask,
)

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
        attention_mask: torch.Tensor | None = None,
        implementation: str = "auto",
        dtype: torch.dtype | None = None,
    ) -> AttentionMask:
        """The attention mask of one forward for this rank's shard (collective over the group).

        Args:
            batch: Batch size.
            local_len: Tokens per row on this rank.
            device: Device of the activations.
            document_ids: ``[B, local_len]`` sharded document ids.
            position_ids: ``[B or 1, local_len]`` sharded positions; restarts (in the full sequence)
                mark packed documents when no ``document_ids`` are given. None: no documents.
            attention_mask: ``[B, local_len]`` sharded padding mask (transformers' meaning, 1 =
                token, 0 = padding). It is all-gathered, and each padding token of the full row
                becomes a document of its own, as in :func:`build_attention_mask`; the returned
                mask's ``padding_mask`` is this rank's part (MoE layers leave padding out).
            implementation: ``auto``, ``sdpa`` or ``flex`` (the ``allgather`` kernel). ``auto`` and
                ``sdpa`` run plain causal rows as per-chunk SDPA kernels where one returns its
                log-sum-exp (CPU; CUDA fp16/bf16 on Hopper or newer: cuDNN); otherwise ``auto`` is
                FlexAttention on CUDA and SDPA with a dense mask elsewhere. The ring has its own kernel.
            dtype: Activation dtype (the per-chunk cuDNN kernels need fp16/bf16); None: not known.

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
        padding: torch.Tensor | None = None
        if attention_mask is not None:
            if tuple(attention_mask.shape) != (batch, local_len):
                raise ValueError(
                    f"attention_mask must have shape {(batch, local_len)} (this rank's shard; 1 = "
                    f"token, 0 = padding), got {tuple(attention_mask.shape)}"
                )
            full = gather_sequence(attention_mask.to(device).contiguous(), self.group)
            full_padding = _padding_mask(full, batch, local_len * n, device)
            if full_padding is not None:  # the same answer on every rank: the rows are the same
                docs = _isolate_padding(docs, full_padding)
                padding = attention_mask.to(device=device, dtype=torch.bool)
        q_pos = self.local_positions(local_len, device)
        cp = ContextParallelMask(self.group, self.mode, n, self.rank, local_len // 2, q_pos, docs)
        if self.mode == "ring":
            return AttentionMask("sdpa", context=cp, padding_mask=padding)
        if docs is None and implementation != "flex" and _chunk_kernels_available(device, dtype):
            return AttentionMask("sdpa", context=cp)  # no mask: the chunks' kernels are causal
        backend = (
            implementation if implementation != "auto" else ("flex" if device.type == "cuda" else "sdpa")
        )
        total = local_len * n
        if backend == "flex":
            q_docs = None if docs is None else docs[:, q_pos]

            def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
                causal = q_pos[q_idx] >= kv_idx
                if docs is None or q_docs is None:
                    return causal
                return causal & (q_docs[b, q_idx] == docs[b, kv_idx])

            block = flex_block_mask(mask_mod, batch, local_len, total, device)
            return AttentionMask("flex", block_mask=block, context=cp, padding_mask=padding)
        kv_pos = torch.arange(total, device=device)
        dense = (q_pos[:, None] >= kv_pos[None, :]).expand(batch, local_len, total)
        if docs is not None:
            dense = dense & (docs[:, q_pos, None] == docs[:, None, :])
        return AttentionMask("sdpa", dense_mask=dense[:, None], context=cp, padding_mask=padding)


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
        return _allgather_attention(q, k, v, mask, scale, self)

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


def _gather_stacked(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Every rank's ``x`` stacked along a new leading dim ``[n, *x.shape]`` (one all-gather, no gradient)."""
    n = dist.get_world_size(group)
    out = x.new_empty((n * x.shape[0], *x.shape[1:]))
    dist.all_gather_into_tensor(out, x.contiguous(), group=group)
    return out.view(n, *x.shape)


class _AllGather(torch.autograd.Function):
    """All-gather along a new leading dim ``[n, *x.shape]``; the backward reduce-scatters (sums)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _gather_stacked(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        out = grad.new_empty(grad.shape[1:])
        dist.reduce_scatter_tensor(out, grad.reshape(-1, *grad.shape[2:]).contiguous(), group=ctx.group)
        return out, None


@torch.compiler.disable  # collectives and saved-tensor hooks run eagerly (the attention kernel is compiled)
def _allgather_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: AttentionMask,
    scale: float,
    cp: ContextParallelMask,
) -> torch.Tensor:
    """Local ``q [B, S, Hq, D]`` attending to the K/V of all ranks, all-gathered (``[B, S, Hq, D]`` out)."""
    local = torch.stack([k, v])
    kv = _unshard_kv(_AllGather.apply(local, cp.group))
    # The attention saves the gathered K/V for its backward: keep this rank's shard instead and
    # gather again when the backward needs them (1/size of the memory, one more all-gather).
    regather = _RegatherSaved(kv, local.detach(), cp.group)
    with torch.autograd.graph.saved_tensors_hooks(regather.pack, regather.unpack):
        if mask.block_mask is None and mask.dense_mask is None:  # plain causal
            return _CausalChunks.apply(q, kv, cp, scale)  # type: ignore[no-any-return]
        qt, kt, vt = q.transpose(1, 2), kv[0].transpose(1, 2), kv[1].transpose(1, 2)
        if mask.backend == "flex":
            out = _flex(qt, kt, vt, mask.block_mask, scale)
        else:
            gqa = qt.shape[1] != kt.shape[1]
            out = F.scaled_dot_product_attention(
                qt, kt, vt, attn_mask=mask.dense_mask, scale=scale, enable_gqa=gqa
            )
    return out.transpose(1, 2)


def _chunk_kernels_available(device: torch.device, dtype: torch.dtype | None) -> bool:
    """Whether :class:`_SdpaKernel` serves ``device`` and ``dtype`` (CPU; CUDA cuDNN fp16/bf16, Hopper+)."""
    if device.type == "cpu":
        return True
    return (
        device.type == "cuda"
        and dtype in (torch.float16, torch.bfloat16)
        and torch.backends.cudnn.is_available()
        and torch.backends.cuda.cudnn_sdp_enabled()
        and torch.cuda.get_device_capability(device) >= (9, 0)
    )


class _SdpaKernel:
    """An SDPA kernel that returns its log-sum-exp, and its backward given any output and log-sum-exp.

    cuDNN on CUDA, FlashAttention-for-CPU on CPU (both take fewer K/V heads than query heads).
    Tensors are ``[B, H, L, D]``; the log-sum-exp is ``[B, Hq, L]``.
    """

    def __init__(self, device: torch.device, scale: float) -> None:
        self.cuda, self.scale = device.type == "cuda", scale

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[Any, ...]]:
        """(out, log-sum-exp, what the backward needs of this call)."""
        aten = torch.ops.aten
        if self.cuda:
            r = aten._scaled_dot_product_cudnn_attention(
                q, k, v, None, True, 0.0, causal, False, scale=self.scale
            )
            return r[0], r[1].squeeze(-1), tuple(r[2:8])
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=self.scale)
        return out, lse, ()

    def backward(
        self,
        grad: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        state: tuple[Any, ...],
        causal: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(dq, dk, dv) of one call, with the softmax of ``out`` / ``lse`` (those of the whole row)."""
        aten = torch.ops.aten
        if self.cuda:
            cum_q, cum_k, max_q, max_k, seed, offset = state
            return aten._scaled_dot_product_cudnn_attention_backward(  # type: ignore[no-any-return]
                grad,
                q,
                k,
                v,
                out,
                lse.unsqueeze(-1),
                seed,
                offset,
                None,
                cum_q,
                cum_k,
                max_q,
                max_k,
                0.0,
                causal,
                scale=self.scale,
            )
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(  # type: ignore[no-any-return]
            grad, q, k, v, out, lse, 0.0, causal, scale=self.scale
        )


def _chunk_blocks(chunk: int, size: int) -> list[tuple[slice, bool]]:
    """Key ranges of global chunk ``chunk`` (``size`` tokens each) and whether each is causal:
    its own keys (causal), then the keys before it (no mask; none for the first chunk)."""
    own = slice(chunk * size, (chunk + 1) * size)
    return [(own, True)] + ([(slice(0, chunk * size), False)] if chunk else [])


class _CausalChunks(torch.autograd.Function):
    """Plain causal attention of the local chunks to the gathered K/V, with SDPA kernels.

    ``q [B, S, Hq, D]`` (this rank's two chunks), ``kv [2, B, T, Hk, D]`` (the whole sequence, in
    order) -> ``[B, S, Hq, D]``. Each chunk's blocks (:func:`_chunk_blocks`) merge by the
    log-sum-exp rule in fp32; the backward runs each block's kernel backward with the merged
    output and log-sum-exp (the whole row's softmax), summing dq over blocks and dK/dV in fp32.
    """

    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, kv: torch.Tensor, cp: ContextParallelMask, scale: float
    ) -> torch.Tensor:
        kern = _SdpaKernel(q.device, scale)
        c = cp.chunk
        qt, k, v = q.transpose(1, 2), kv[0].transpose(1, 2), kv[1].transpose(1, 2)
        out = q.new_empty(q.shape)  # contiguous [B, S, Hq, D], like the gradient the backward gets
        lse = torch.empty(qt.shape[:-1], dtype=torch.promote_types(q.dtype, torch.float32), device=q.device)
        states = []
        for slot, chunk in enumerate(cp.chunks_of(cp.rank)):
            rows = slice(slot * c, (slot + 1) * c)
            o: torch.Tensor | None = None
            for keys, causal in _chunk_blocks(chunk, c):
                o_b, l_b, state = kern.forward(qt[:, :, rows], k[:, :, keys], v[:, :, keys], causal)
                states.append(state)
                if o is None:
                    o, lse[:, :, rows] = o_b.to(lse.dtype), l_b
                else:
                    o, lse[:, :, rows] = _merge(o, lse[:, :, rows], o_b, l_b)
            assert o is not None
            out.transpose(1, 2)[:, :, rows] = o
        ctx.save_for_backward(q, kv, out, lse)
        ctx.cp, ctx.kern, ctx.states = cp, kern, states
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, None]:
        q, kv, out, lse = ctx.saved_tensors
        cp: ContextParallelMask = ctx.cp
        c, acc = cp.chunk, lse.dtype
        qt, k, v = q.transpose(1, 2), kv[0].transpose(1, 2), kv[1].transpose(1, 2)
        grad = grad_out.contiguous().transpose(1, 2)  # the layout of out (the kernels' output)
        dq = torch.zeros(qt.shape, dtype=acc, device=q.device)
        dkv = torch.zeros((2, *k.shape), dtype=acc, device=q.device)  # [2, B, Hk, T, D]
        states = iter(ctx.states)
        for slot, chunk in enumerate(cp.chunks_of(cp.rank)):
            rows = slice(slot * c, (slot + 1) * c)
            args = (grad[:, :, rows], qt[:, :, rows])
            o, lse_rows = out.transpose(1, 2)[:, :, rows], lse[:, :, rows].contiguous()
            for keys, causal in _chunk_blocks(chunk, c):
                dq_b, dk_b, dv_b = ctx.kern.backward(
                    *args, k[:, :, keys], v[:, :, keys], o, lse_rows, next(states), causal
                )
                dq[:, :, rows] += dq_b
                dkv[0, :, :, keys] += dk_b
                dkv[1, :, :, keys] += dv_b
        return dq.transpose(1, 2).to(q.dtype), dkv.transpose(2, 3).to(kv.dtype), None, None


def _unshard_kv(gathered: torch.Tensor) -> torch.Tensor:
    """``[n, 2, B, S/n, Hk, D]`` gathered shards -> ``[2, B, S, Hk, D]`` K/V in sequence order."""
    return unshard_sequence(list(gathered.unbind(0)), dim=2)


class _RegatherSaved:
    """``saved_tensors_hooks`` that store a saved view of the gathered K/V as this rank's shard.

    ``pack`` replaces a saved tensor that shares the storage of ``full`` by its view geometry;
    ``unpack`` all-gathers the shards again (once per backward: the views saved by one forward
    share one gather) and returns the same view of the new tensor. Other saved tensors pass through.
    Both ranks unpack in the same backward node, so the all-gathers pair up.
    """

    def __init__(self, full: torch.Tensor, local: torch.Tensor, group: dist.ProcessGroup) -> None:
        self.storage = full.untyped_storage().data_ptr()
        self.local, self.group = local, group
        self.pending = 0  # packed views not yet unpacked
        self.full: torch.Tensor | None = None

    def pack(self, t: torch.Tensor) -> Any:
        if t.untyped_storage().data_ptr() != self.storage or t.device != self.local.device:
            return t
        self.pending += 1
        return tuple(t.shape), t.stride(), t.storage_offset()

    def unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        shape, stride, offset = packed
        if self.full is None:
            self.full = _unshard_kv(_gather_stacked(self.local, self.group))
        view = self.full.as_strided(shape, stride, offset)
        self.pending -= 1
        if self.pending <= 0:  # every view has its tensor: drop the reference (retain_graph re-gathers)
            self.full, self.pending = None, 0
        return view


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
    if q_chunk == kv_chunk:
        mask = (q_idx[:, None] >= torch.arange(c, device=q_idx.device)[None, :])[None, None, :, None]
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


def _merge(
    out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two partial softmax results by the log-sum-exp rule (rows with no keys stay 0)."""
    new = torch.logaddexp(lse, block_lse)
    ref = torch.where(torch.isinf(new), torch.zeros_like(new), new)
    out = out * torch.exp(lse - ref)[..., None] + block_out * torch.exp(block_lse - ref)[..., None]
    return out, new


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
    ) -> torch.Tensor:
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
                    o, lse_t = _merge(
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
        return _unrows(out).to(q.dtype)

    @staticmethod
    def backward(
        ctx: Any, grad_out: torch.Tensor
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
