"""All-gather context parallelism: gather K and V over the group, attend the local queries to the
whole sequence (differentiable: the backward reduce-scatters the K/V gradients).

Attention whose K/V are a per-token function of a narrower latent (multi-head latent attention)
gathers the latent instead (:func:`allgather_latent_attention`) and expands it on every rank.

Plain causal rows (no documents, padding, window or sinks) run SDPA kernels per local chunk: the
chunk against its own keys (causal) and against the keys before it (no mask), merged by the
log-sum-exp rule (cuDNN on Hopper+ GPUs for fp16/bf16, FlashAttention-for-CPU on CPU); otherwise
one FlexAttention (CUDA) or dense-mask call whose mask is causal in global positions, per document
and windowed. The gathered K/V are not kept for the backward: it gathers them again (or, for a
gathered latent, expands the saved latent again).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from plait.dist_core.context_parallel import unshard_sequence
from plait.models.common.attention.context._aten import SdpaLseKernel
from plait.models.common.attention.context.group import ContextParallelMask
from plait.models.common.attention.context.lse import merge_lse
from plait.models.common.attention.kernels import masked_attention
from plait.models.common.attention.mask import AttentionMask

__all__ = ["allgather_attention", "allgather_latent_attention", "gather_stacked"]


def gather_stacked(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
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
        return gather_stacked(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        out = grad.new_empty(grad.shape[1:])
        dist.reduce_scatter_tensor(out, grad.reshape(-1, *grad.shape[2:]).contiguous(), group=ctx.group)
        return out, None


@torch.compiler.disable  # collectives and saved-tensor hooks run eagerly (the attention kernel is compiled)
def allgather_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: AttentionMask,
    scale: float,
    cp: ContextParallelMask,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Local ``q [B, S, Hq, D]`` attending to the K/V of all ranks, all-gathered (``[B, S, Hq, D]`` out)."""
    local = torch.stack([k, v])
    kv = _unshard(_AllGather.apply(local, cp.group), dim=2)
    # The attention saves the gathered K/V for its backward: keep this rank's shard instead and
    # gather again when the backward needs them (1/size of the memory, one more all-gather).
    shard = local.detach()
    return _attend_gathered(
        q, kv, mask, scale, cp, sinks, lambda: _unshard(gather_stacked(shard, cp.group), 2)
    )


@torch.compiler.disable  # collectives and saved-tensor hooks run eagerly
def allgather_latent_attention(
    q: torch.Tensor,
    latent: torch.Tensor,
    expand: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    mask: AttentionMask,
    scale: float,
    cp: ContextParallelMask,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Local ``q [B, S, Hq, D]`` attending to K/V expanded from the all-gathered per-token latent.

    The all-gather moves ``latent [B, S, L]`` (its backward reduce-scatters the latent's gradient);
    every rank then expands the whole sequence's latent with ``expand`` (``[B, T, L]`` ->
    ``k, v [B, T, Hk, D]``; the gradient of its weights is this rank's queries' share, summed over
    the group by data parallelism like every other weight's). The expanded K/V are not kept for the
    backward: it expands the saved latent again (one more ``expand``, no communication).

    Returns:
        ``[B, S, Hq, D]``.
    """
    full = _unshard(_AllGather.apply(latent, cp.group), dim=1)
    kv = torch.stack(expand(full))
    saved = full.detach()

    def rebuild() -> torch.Tensor:
        with torch.no_grad():
            return torch.stack(expand(saved))

    return _attend_gathered(q, kv, mask, scale, cp, sinks, rebuild)


def _attend_gathered(
    q: torch.Tensor,
    kv: torch.Tensor,
    mask: AttentionMask,
    scale: float,
    cp: ContextParallelMask,
    sinks: torch.Tensor | None,
    rebuild: Callable[[], torch.Tensor],
) -> torch.Tensor:
    """Local queries to the whole sequence's ``kv [2, B, T, Hk, D]``; the backward gets the K/V it
    saved from ``rebuild()`` (the same tensor again) instead of keeping them."""
    with torch.autograd.graph.saved_tensors_hooks(*_RebuildSaved(kv, rebuild).hooks()):
        if mask.block_mask is None and mask.dense_mask is None:  # plain causal
            return _CausalChunks.apply(q, kv, cp, scale)  # type: ignore[no-any-return]
        qt, kt, vt = q.transpose(1, 2), kv[0].transpose(1, 2), kv[1].transpose(1, 2)
        block = mask.block_mask if mask.backend == "flex" else None
        out = masked_attention(
            qt, kt, vt, scale, kernels=mask.kernels, block_mask=block, dense_mask=mask.dense_mask, sinks=sinks
        )
    return out.transpose(1, 2)


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
        kern = SdpaLseKernel(q.device, scale)
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
                    o, lse[:, :, rows] = merge_lse(o, lse[:, :, rows], o_b, l_b)
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


def _unshard(gathered: torch.Tensor, dim: int) -> torch.Tensor:
    """``[n, ...]`` gathered shards (sequence at ``dim`` of the result) -> the sequence in order."""
    return unshard_sequence(list(gathered.unbind(0)), dim=dim)


class _RebuildSaved:
    """``saved_tensors_hooks`` that store a saved view of the gathered K/V as its geometry only.

    ``pack`` replaces a saved tensor that shares the storage of ``full`` by its view geometry;
    ``unpack`` calls ``rebuild`` (once per backward: the views saved by one forward share one
    rebuild; a re-gather is a collective, and both ranks unpack in the same backward node, so the
    all-gathers pair up) and returns the same view of the new tensor. Other saved tensors pass through.
    """

    def __init__(self, full: torch.Tensor, rebuild: Callable[[], torch.Tensor]) -> None:
        self.storage = full.untyped_storage().data_ptr()
        self.device = full.device
        self.rebuild = rebuild
        self.pending = 0  # packed views not yet unpacked
        self.full: torch.Tensor | None = None

    def hooks(self) -> tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]]:
        """``(pack, unpack)`` for :func:`torch.autograd.graph.saved_tensors_hooks`."""
        return self.pack, self.unpack

    def pack(self, t: torch.Tensor) -> Any:
        if t.untyped_storage().data_ptr() != self.storage or t.device != self.device:
            return t
        self.pending += 1
        return tuple(t.shape), t.stride(), t.storage_offset()

    def unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        shape, stride, offset = packed
        if self.full is None:
            self.full = self.rebuild()
        view = self.full.as_strided(shape, stride, offset)
        self.pending -= 1
        if self.pending <= 0:  # every view has its tensor: drop the reference (retain_graph rebuilds)
            self.full, self.pending = None, 0
        return view
