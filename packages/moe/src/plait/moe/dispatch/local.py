"""Dispatch without expert parallelism: sort by expert, grouped GEMM, unsort."""

from __future__ import annotations

from typing import TYPE_CHECKING

from plait.moe.permute import combine_rows, dispatch_rows, sort_by_expert
from torch import Tensor

if TYPE_CHECKING:
    from plait.moe.experts import GroupedExperts


class LocalDispatcher:
    """All experts on this rank. Dropless routing needs no device sync; dropping needs one (kept rows)."""

    def __call__(
        self,
        x: Tensor,
        topk_idx: Tensor,
        topk_weights: Tensor,
        experts: GroupedExperts,
        has_dropped: bool = False,
    ) -> Tensor:
        num_tokens, top_k = topk_idx.shape
        num_experts = experts.num_experts
        perm, counts = sort_by_expert(topk_idx, num_experts)
        if has_dropped:
            perm = perm[: num_tokens * top_k - int(counts[num_experts].item())]
        rows = dispatch_rows(x, perm, top_k)
        row_w = topk_weights.reshape(-1)[perm]
        out = experts(rows, counts[:num_experts], row_w)
        return combine_rows(out, perm, num_tokens, top_k)

    def __repr__(self) -> str:
        return "LocalDispatcher()"
