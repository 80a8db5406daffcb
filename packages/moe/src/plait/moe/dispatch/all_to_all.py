"""Expert-parallel dispatch over ``torch.distributed`` all-to-all (NCCL on GPUs, gloo on CPUs).

Per forward: (1) permute local assignments by global expert (``plait.kernels.permute``; experts are
contiguous per EP rank, so this also groups them by destination rank); (2) exchange per-expert counts (``all_to_all_single`` of
``[E]`` int64), one host copy of the split sizes; (3) send rows and their routing weights; (4)
regroup received rows from ``[source rank][local expert]`` to ``[local expert][source rank]``; (5)
grouped GEMM; then everything in reverse. Every step is differentiable.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from plait.kernels import permute, unpermute
from torch import Tensor

if TYPE_CHECKING:
    from plait.moe.experts import GroupedExperts


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: Tensor, output_splits: list[int], input_splits: list[int], group: dist.ProcessGroup
    ) -> Tensor:
        ctx.output_splits, ctx.input_splits, ctx.group = output_splits, input_splits, group
        out = x.new_empty((sum(output_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        out = _AllToAll.apply(grad.contiguous(), ctx.input_splits, ctx.output_splits, ctx.group)
        return out, None, None, None


def all_to_all(
    x: Tensor, output_splits: list[int], input_splits: list[int], group: dist.ProcessGroup
) -> Tensor:
    """Differentiable ``all_to_all_single`` along dim 0 with uneven splits."""
    return _AllToAll.apply(x, output_splits, input_splits, group)  # type: ignore[no-any-return]


class AllToAllDispatcher:
    """Experts sharded over the ranks of ``group`` (rank r holds experts ``[r*E/P, (r+1)*E/P)``).

    Args:
        group: The expert-parallel process group.
    """

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.ep_size = dist.get_world_size(group)

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
        # Expert-major order over the global experts is also destination-rank order (experts are
        # contiguous per rank); dropped slots (sentinel E) are left in the buffer's unused tail.
        rows, row_w, row_map, send_counts = permute(x, topk_idx, num_experts, topk_weights)
        assert row_w is not None
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)  # [src, local expert]
        # The one host sync of a forward: split sizes for the token all-to-all.
        splits = torch.cat(
            [send_counts.view(ep, n_local).sum(1), recv_counts.view(ep, n_local).sum(1)]
        ).tolist()
        input_splits, output_splits = splits[:ep], splits[ep:]
        n_send = sum(input_splits)
        recv_rows = all_to_all(rows[:n_send], output_splits, input_splits, self.group)
        recv_w = all_to_all(row_w[:n_send], output_splits, input_splits, self.group)

        # Received order is [source rank][local expert]; the experts need [local expert][source rank]:
        # a stable permute by local expert.
        seg = torch.repeat_interleave(
            torch.arange(ep * n_local, device=x.device), recv_counts, output_size=sum(output_splits)
        )
        local_idx = (seg % n_local).unsqueeze(1)
        local_rows, local_w, local_map, local_counts = permute(
            recv_rows, local_idx, n_local, recv_w.unsqueeze(1)
        )
        out = unpermute(experts(local_rows, local_counts, local_w), local_map)
        back = all_to_all(out, input_splits, output_splits, self.group)
        # Back into the full permuted buffer (the dropped tail is never read by unpermute).
        back = torch.nn.functional.pad(back, (0, 0, 0, rows.shape[0] - n_send))
        return unpermute(back, row_map)

    def __repr__(self) -> str:
        return f"AllToAllDispatcher(ep_size={self.ep_size})"
