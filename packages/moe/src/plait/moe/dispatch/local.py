"""Dispatch without expert parallelism: permute by expert, grouped GEMM, unpermute."""

from __future__ import annotations

from typing import TYPE_CHECKING

from plait.kernels import permute, unpermute
from torch import Tensor

if TYPE_CHECKING:
    from plait.moe.experts import GroupedExperts


class LocalDispatcher:
    """All experts on this rank. No device sync, dropped slots included: the permuted buffer has a
    static size (``T * k`` rows) and dropped slots leave its tail unused."""

    def __call__(
        self,
        x: Tensor,
        topk_idx: Tensor,
        topk_weights: Tensor,
        experts: GroupedExperts,
        has_dropped: bool = False,
    ) -> Tensor:
        # Dropped slots carry the sentinel E, outside [0, E): permute skips them (has_dropped or not).
        rows, row_w, row_map, tokens_per_expert = permute(x, topk_idx, experts.num_experts, topk_weights)
        return unpermute(experts(rows, tokens_per_expert, row_w), row_map)

    def __repr__(self) -> str:
        return "LocalDispatcher()"
