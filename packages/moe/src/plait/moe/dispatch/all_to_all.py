"""Expert-parallel dispatch over ``torch.distributed`` all-to-all (NCCL on GPUs, gloo on CPUs).

Per forward: (1) split the local tokens into ``num_chunks`` chunks and permute each chunk's
assignments by global expert (``plait.kernels.permute``; experts are contiguous per EP rank, so this
also groups them by destination rank); (2) exchange every chunk's per-expert counts in one
``all_to_all_single`` and copy the split sizes to the host once; (3) per chunk, send rows and their
routing weights; (4) regroup received rows from ``[source rank][local expert]`` to
``[local expert][source rank]``; (5) grouped GEMM; (6) send the results back and unpermute.

The all-to-alls are asynchronous and pipelined with the expert compute: chunk ``i + 1``'s dispatch
is in flight while chunk ``i``'s experts run, and chunk ``i``'s combine while chunk ``i + 1``'s
experts run. Backward mirrors this: each all-to-all's backward is issued asynchronously where its
gradient appears and waited for only where the gradient is used. Waits are stream waits on CUDA
(no host synchronisation). Every step is differentiable.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from plait.kernels import permute, unpermute
from torch import Tensor

if TYPE_CHECKING:
    from plait.moe.experts import GroupedExperts


class _Pending:
    """The in-flight work of one asynchronous all-to-all: its forward, then its backward (and the
    backward's result, which autograd cannot carry from the wait node to the start node: its shape
    is the start's input, not the wait's)."""

    __slots__ = ("bwd", "bwd_out", "fwd")

    def __init__(self) -> None:
        self.fwd: Any = None
        self.bwd: Any = None
        self.bwd_out: Tensor | None = None


def _issue(
    x: Tensor, output_splits: list[int], input_splits: list[int], group: dist.ProcessGroup
) -> tuple[Tensor, Any]:
    out = x.new_empty((sum(output_splits), *x.shape[1:]))
    work = dist.all_to_all_single(
        out, x.contiguous(), output_splits, input_splits, group=group, async_op=True
    )
    return out, work


class _AllToAllStart(torch.autograd.Function):
    """Issues the all-to-all (forward); waits for the backward one (backward)."""

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        output_splits: list[int],
        input_splits: list[int],
        group: dist.ProcessGroup,
        pending: _Pending,
    ) -> Tensor:
        ctx.pending = pending
        out, pending.fwd = _issue(x, output_splits, input_splits, group)
        return out

    @staticmethod
    def backward(ctx: Any, _grad: Tensor) -> tuple[Tensor, None, None, None, None]:
        pending = ctx.pending
        pending.bwd.wait()
        grad_in, pending.bwd_out, pending.bwd = pending.bwd_out, None, None
        return grad_in, None, None, None, None


class _AllToAllWait(torch.autograd.Function):
    """Waits for the all-to-all (forward); issues the backward one (backward)."""

    @staticmethod
    def forward(
        ctx: Any,
        out: Tensor,
        output_splits: list[int],
        input_splits: list[int],
        group: dist.ProcessGroup,
        pending: _Pending,
    ) -> Tensor:
        ctx.output_splits, ctx.input_splits, ctx.group, ctx.pending = (
            output_splits,
            input_splits,
            group,
            pending,
        )
        pending.fwd.wait()
        pending.fwd = None  # a finished work object still holds its buffers: let them go
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None, None]:
        pending = ctx.pending
        pending.bwd_out, pending.bwd = _issue(grad, ctx.input_splits, ctx.output_splits, ctx.group)
        return grad, None, None, None, None  # a placeholder: the start node returns bwd_out


class _AsyncAllToAll:
    """A differentiable all-to-all in two halves: constructing it issues the all-to-all, :meth:`wait`
    returns the result; in backward, the wait's half issues the reverse all-to-all and the start's
    half waits for it."""

    def __init__(
        self, x: Tensor, output_splits: list[int], input_splits: list[int], group: dist.ProcessGroup
    ) -> None:
        self._args = (output_splits, input_splits, group, _Pending())
        self._out: Tensor = _AllToAllStart.apply(x, *self._args)

    def wait(self) -> Tensor:
        return _AllToAllWait.apply(self._out, *self._args)  # type: ignore[no-any-return]


def all_to_all(
    x: Tensor, output_splits: list[int], input_splits: list[int], group: dist.ProcessGroup
) -> Tensor:
    """Differentiable ``all_to_all_single`` along dim 0 with uneven splits."""
    return _AsyncAllToAll(x, output_splits, input_splits, group).wait()


class AllToAllDispatcher:
    """Experts sharded over the ranks of ``group`` (rank r holds experts ``[r*E/P, (r+1)*E/P)``).

    Args:
        group: The expert-parallel process group.
        num_chunks: Token chunks pipelined through dispatch, experts and combine so that the
            all-to-alls overlap the grouped GEMMs (1 = no overlap: dispatch, compute, combine in
            sequence). Outputs do not depend on it. Every rank of ``group`` must use the same value.

    Raises:
        ValueError: ``num_chunks < 1``.
    """

    def __init__(self, group: dist.ProcessGroup, num_chunks: int = 1) -> None:
        if num_chunks < 1:
            raise ValueError(f"AllToAllDispatcher: num_chunks must be >= 1, got {num_chunks}")
        self.group = group
        self.ep_size = dist.get_world_size(group)
        self.num_chunks = num_chunks

    def __call__(
        self,
        x: Tensor,
        topk_idx: Tensor,
        topk_weights: Tensor,
        experts: GroupedExperts,
        has_dropped: bool = False,
    ) -> Tensor:
        num_experts, ep = experts.num_experts, self.ep_size
        n_local = num_experts // ep
        # The same chunk count on every rank (each chunk is a collective), whatever its token count:
        # a rank with fewer tokens than chunks sends empty chunks.
        n = self.num_chunks
        # Expert-major order over the global experts is also destination-rank order (experts are
        # contiguous per rank); dropped slots (sentinel E) are left in each buffer's unused tail.
        chunks = [
            permute(xc, ic, num_experts, wc)
            for xc, ic, wc in zip(
                x.tensor_split(n), topk_idx.tensor_split(n), topk_weights.tensor_split(n), strict=True
            )
        ]
        # One counts exchange for all chunks: send [dst rank][chunk][local expert], receive
        # [src rank][chunk][local expert]; then the one host sync of a forward (the split sizes).
        send_counts = torch.stack([c[3] for c in chunks]).view(n, ep, n_local).transpose(0, 1).contiguous()
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        sizes = torch.stack([send_counts.sum(2), recv_counts.sum(2)]).transpose(1, 2).tolist()
        send_splits, recv_splits = sizes  # [chunk][rank]

        def dispatch(i: int) -> tuple[_AsyncAllToAll, _AsyncAllToAll]:
            rows, row_w, _, _ = chunks[i]
            assert row_w is not None
            n_send = sum(send_splits[i])
            return (
                _AsyncAllToAll(rows[:n_send], recv_splits[i], send_splits[i], self.group),
                _AsyncAllToAll(row_w[:n_send], recv_splits[i], send_splits[i], self.group),
            )

        segments = torch.arange(ep * n_local, device=x.device)  # [source rank][local expert]
        in_flight = dispatch(0)
        combines = []
        for i in range(n):
            arrived, in_flight = in_flight, (dispatch(i + 1) if i + 1 < n else in_flight)
            recv_rows, recv_w = arrived[0].wait(), arrived[1].wait()
            # Received order is [source rank][local expert]; the experts need [local expert][source
            # rank]: a stable permute by local expert.
            seg = torch.repeat_interleave(
                segments, recv_counts[:, i].reshape(-1), output_size=sum(recv_splits[i])
            )
            local_rows, local_w, local_map, local_counts = permute(
                recv_rows, (seg % n_local).unsqueeze(1), n_local, recv_w.unsqueeze(1)
            )
            out = unpermute(experts(local_rows, local_counts, local_w), local_map)
            combines.append(_AsyncAllToAll(out, send_splits[i], recv_splits[i], self.group))
        outs = []
        for (rows, _, row_map, _), combine in zip(chunks, combines, strict=True):
            back = combine.wait()
            # Back into the chunk's full permuted buffer (the dropped tail is never read by unpermute).
            back = torch.nn.functional.pad(back, (0, 0, 0, rows.shape[0] - back.shape[0]))
            outs.append(unpermute(back, row_map))
        return outs[0] if n == 1 else torch.cat(outs)

    def __repr__(self) -> str:
        return f"AllToAllDispatcher(ep_size={self.ep_size}, num_chunks={self.num_chunks})"
