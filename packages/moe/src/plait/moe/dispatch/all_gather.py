"""Expert-parallel dispatch by all-gather and reduce-scatter of tokens (no host synchronisation).

Per forward: (1) all-gather every rank's tokens, routing weights and expert ids over the EP group
(``[P*T, H]``: every rank sees every token once, however many of its experts the token picked), as
one collective on one packed tensor; (2) permute the assignments to this rank's experts (other
ranks' experts are skipped), grouped GEMM, and sum each token's local expert outputs; (3)
reduce-scatter the ``[P*T, H]`` partial sums, so each rank gets its own tokens' outputs summed over
all ranks' experts. The backward is the mirror image (one coalesced reduce-scatter of the token and
routing-weight gradients, each summed in its own dtype; an all-gather of the output gradient).

All shapes are static and every index stays on the device, so the host never waits for the GPU and
a MoE decoder layer compiles as one graph. The exchanges move ``(P-1) * T`` token rows each way per
rank, against ``(P-1)/P * T * k`` rows for the exact-split all-to-all: fewer bytes whenever the EP
size is below ``k`` (top-``k``) or about. Each rank computes exactly its experts' assignments, as the
all-to-all does.

The permuted buffer (and with it every expert activation: the permuted rows, the gate/up and SwiGLU
outputs kept for the backward, the elementwise work over them) is sized by a static bound. The exact
bound is ``P * T * k`` rows, of which a rank uses ``T * k`` when the routing is balanced: ``P`` times
the activations of one GPU. With ``buffer_factor=f`` the buffer holds ``min(P*T*k, ceil(f * T * k))``
rows, ``f`` times the balanced share; a device-side assert (no host wait) stops the step when this
rank's experts get more assignments than that, so nothing is ever dropped silently.

With ``num_chunks > 1`` the local tokens are split into that many chunks: every chunk's all-gather is
issued first, then each chunk is permuted, computed and reduce-scattered in turn, so that a chunk's
collectives can run while a neighbouring chunk's experts compute (the collectives are asynchronous; in
a compiled graph whether they overlap is up to Inductor's scheduling of their waits). Each token is
computed as without chunks; only the grouped GEMMs' row counts change (and the buffer bound, per chunk).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from plait.kernels import permute, permuted_rows, unpermute
from torch import Tensor

if TYPE_CHECKING:
    from plait.moe.experts import GroupedExperts

# torch >= 2.15 renamed the functional collectives (the old names warn on every eager call); both
# spellings are traceable by torch.compile.
_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
_reduce_scatter = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor
_reduce_scatter_autograd = (
    getattr(funcol, "reduce_scatter_single_autograd", None) or funcol.reduce_scatter_tensor_autograd
)
_reduce_scatter_coalesced = (
    getattr(funcol, "reduce_scatter_single_coalesced", None) or funcol.reduce_scatter_tensor_coalesced
)

_OPTION = "parallel.expert_buffer_factor"


def _byte_layout(parts: list[tuple[torch.dtype, int]]) -> tuple[list[int], int]:
    """Byte offset of each ``(dtype, columns)`` piece inside a packed row, and the row's byte width.

    Pieces go widest element first and the row is padded to a multiple of the widest element, so
    every piece starts, and every row strides, at a multiple of its own element size (what
    ``Tensor.view(dtype)`` needs to read it back in place).
    """
    offsets = [0] * len(parts)
    pos = 0
    for i in sorted(range(len(parts)), key=lambda i: -parts[i][0].itemsize):
        offsets[i] = pos
        pos += parts[i][0].itemsize * parts[i][1]
    widest = max(dtype.itemsize for dtype, _ in parts)
    return offsets, -(-pos // widest) * widest


def _pack(tensors: list[Tensor]) -> Tensor:
    """``[T, bytes]`` uint8: each ``[T, c_i]`` tensor's bytes side by side per row (:func:`_byte_layout`)."""
    offsets, width = _byte_layout([(t.dtype, t.shape[1]) for t in tensors])
    order = sorted(range(len(tensors)), key=lambda i: offsets[i])
    pieces = [tensors[i].contiguous().view(torch.uint8) for i in order]
    used = sum(p.shape[1] for p in pieces)
    if width > used:
        pieces.append(pieces[0].new_zeros((pieces[0].shape[0], width - used)))
    return torch.cat(pieces, dim=1)


def _unpack(packed: Tensor, parts: list[tuple[torch.dtype, int]]) -> list[Tensor]:
    """The pieces of a packed ``[R, bytes]`` tensor as strided views in their own dtypes (no copy)."""
    offsets, _ = _byte_layout(parts)
    return [
        packed[:, off : off + dtype.itemsize * cols].view(dtype)
        for off, (dtype, cols) in zip(offsets, parts, strict=True)
    ]


class _PackedAllGather(torch.autograd.Function):
    """All-gather tokens ``[T, H]``, routing weights ``[T, k]`` and expert ids ``[T, k]`` as one collective.

    The three are packed per row into one byte tensor, gathered once, and read back as views in their
    own dtypes. The backward reduce-scatters the token and weight gradients in one coalesced call,
    each summed in its own dtype (a sum over reinterpreted bytes would be wrong); the ids get none.
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor, ids: Tensor, group: dist.ProcessGroup) -> Any:  # type: ignore[override]
        parts = [(x.dtype, x.shape[1]), (w.dtype, w.shape[1]), (ids.dtype, ids.shape[1])]
        gathered = _all_gather(_pack([x, w, ids]), 0, group)
        xs, ws, idx = _unpack(gathered, parts)
        ctx.group = group
        ctx.mark_non_differentiable(idx)
        return xs, ws, idx

    @staticmethod
    def backward(ctx: Any, gx: Tensor, gw: Tensor, _gids: Any) -> Any:  # type: ignore[override]
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dx = dw = None
        if need_x and need_w:  # one call, two reductions (NCCL: one group), each in its own dtype
            dx, dw = _reduce_scatter_coalesced([gx.contiguous(), gw.contiguous()], "sum", [0, 0], ctx.group)
        elif need_x:
            dx = _reduce_scatter(gx.contiguous(), "sum", 0, ctx.group)
        elif need_w:
            dw = _reduce_scatter(gw.contiguous(), "sum", 0, ctx.group)
        return _waited(dx), _waited(dw), None, None


def _waited(t: Tensor | None) -> Tensor | None:
    """A plain tensor for autograd: eager functional collectives return an async wrapper (traced ones
    are waited already), which must not end up as a ``.grad``."""
    return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t


def _overflow_message(rows: int, factor: float | None, exact: int) -> str:
    """The bounded buffer's assert message: under 255 characters, CUDA's limit for ``_assert_async``."""
    now = "None" if factor is None else f"{factor:.6g}"
    msg = (
        f"AllGatherDispatcher: this rank's experts got more token assignments than its expert buffer's "
        f"{rows} rows; raise {_OPTION} (now {now}) or set it to None (exact bound, {exact} rows)"
    )
    return msg if len(msg) < 255 else msg[:254]


def _clamp_groups(tokens_per_expert: Tensor, rows: int) -> Tensor:
    """The groups cut at ``rows`` rows (a grouped GEMM must never read or write past its buffer)."""
    ends = torch.cumsum(tokens_per_expert, 0).clamp(max=rows)
    return torch.diff(ends, prepend=ends.new_zeros(1))


class AllGatherDispatcher:
    """Dispatch by all-gathering tokens over the EP group and reduce-scattering the expert outputs.

    Every rank of ``group`` must pass the same number of tokens (equal-shaped microbatches); a
    device-side assert stops the step otherwise (on CUDA an asynchronous error, raised at the next
    synchronisation).
    Functional collectives (``torch.distributed._functional_collectives``): traceable by
    ``torch.compile``, waited for where their results are first used (eagerly; a compiled graph
    waits right after each collective unless Inductor reorders it). Per chunk, the forward makes one
    all-gather (tokens, routing weights and expert ids packed into one tensor) and one
    reduce-scatter; the backward one coalesced reduce-scatter and one all-gather; plus, once per
    forward, the all-gather of one token count per rank for the equal-count check.

    Args:
        group: The EP process group.
        num_chunks: Token chunks whose exchanges are issued ahead of their compute (module
            docstring), capped at the token count. 1 (default) = no chunking.
        buffer_factor: ``None`` (default): the permuted buffer of each chunk has the exact bound,
            ``P * Tc * k`` rows (``Tc`` the chunk's tokens), that no routing can overflow. A number
            ``f >= 1``: ``min(P * Tc * k, ceil(f * Tc * k))`` rows, ``f`` times what this rank's
            experts get when the routing is balanced; expert activations and elementwise work then
            scale with ``f`` instead of ``P``. A step whose routing sends more assignments to this
            rank's experts stops with a device-side assert naming ``parallel.expert_buffer_factor``
            (on CPU a ``RuntimeError`` at once; on CUDA an asynchronous error, raised at the next
            synchronisation); nothing is dropped silently.

    Raises:
        ValueError: ``num_chunks < 1``, or ``buffer_factor`` not a finite number >= 1.
    """

    def __init__(
        self, group: dist.ProcessGroup, num_chunks: int = 1, buffer_factor: float | None = None
    ) -> None:
        if num_chunks < 1:
            raise ValueError(f"AllGatherDispatcher: num_chunks must be >= 1, got {num_chunks}")
        if buffer_factor is not None:
            if (
                isinstance(buffer_factor, bool)
                or not isinstance(buffer_factor, int | float)
                or not math.isfinite(buffer_factor)
                or buffer_factor < 1
            ):
                raise ValueError(
                    f"AllGatherDispatcher: buffer_factor ({_OPTION}) must be a finite number >= 1 or None, "
                    f"got {buffer_factor!r}"
                )
            buffer_factor = float(buffer_factor)
        self.group = group
        self.ep_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.num_chunks = num_chunks
        self.buffer_factor = buffer_factor

    def buffer_rows(self, num_tokens: int, top_k: int, num_local_experts: int) -> int:
        """Rows of the permuted buffer for a chunk of ``num_tokens`` local tokens (static)."""
        exact = permuted_rows(self.ep_size * num_tokens, top_k, num_local_experts)
        if self.buffer_factor is None:
            return exact
        return min(exact, math.ceil(self.buffer_factor * num_tokens * top_k))

    def __call__(
        self,
        x: Tensor,
        topk_idx: Tensor,
        topk_weights: Tensor,
        experts: GroupedExperts,
        has_dropped: bool = False,
    ) -> Tensor:
        n_local = experts.num_experts // self.ep_size
        # Equal token counts on every rank, checked on the device (no host wait): an all-gather of
        # unequal shards would read past the smaller ones. A separate collective on purpose: a count
        # carried inside the packed gather would arrive only through that (corrupted) gather.
        tokens = torch.full((1,), x.shape[0], dtype=torch.int64, device=x.device)
        torch._assert_async(  # noqa: SLF001  the only device-side assertion (no host wait)
            torch.all(_all_gather(tokens, 0, self.group) == tokens),
            "AllGatherDispatcher: every rank of the EP group must pass the same number of tokens",
        )
        # Ids travel as int32 (half the bytes of int64) whenever the expert count allows.
        id_dtype = torch.int32 if experts.num_experts < 2**31 else torch.int64
        n = max(1, min(self.num_chunks, x.shape[0]))  # static: every rank has the same token count
        gathered = [
            _PackedAllGather.apply(xc, wc, ic.to(id_dtype), self.group)
            for xc, wc, ic in zip(x.tensor_split(n), topk_weights.tensor_split(n), topk_idx.tensor_split(n))
        ]
        outs = []
        for (xs, ws, ids), tc in zip(gathered, (c.shape[0] for c in x.tensor_split(n)), strict=True):
            # Ids of this rank's experts become [0, n_local); other ranks' experts and the dropped
            # sentinel E fall outside that range and are skipped by permute.
            ids = ids - self.rank * n_local
            top_k = ids.shape[1]
            rows = self.buffer_rows(tc, top_k, n_local)
            bounded = rows < permuted_rows(self.ep_size * tc, top_k, n_local)
            permuted, row_w, row_map, counts = permute(
                xs, ids, n_local, ws, max_rows=rows if bounded else None
            )
            if bounded:
                torch._assert_async(  # noqa: SLF001
                    counts.sum() <= rows,
                    _overflow_message(rows, self.buffer_factor, self.ep_size * tc * top_k),
                )
                counts = _clamp_groups(counts, rows)  # never past the buffer, even before the assert fires
            partial = unpermute(experts(permuted, counts, row_w), row_map)
            outs.append(_reduce_scatter_autograd(partial, "sum", 0, self.group))
        return outs[0] if n == 1 else torch.cat(outs)

    def __repr__(self) -> str:
        return (
            f"AllGatherDispatcher(ep_size={self.ep_size}, num_chunks={self.num_chunks}, "
            f"buffer_factor={self.buffer_factor})"
        )
