"""The dispatcher protocol."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from torch import Tensor

if TYPE_CHECKING:
    from plait.moe.experts import GroupedExperts


class TokenDispatcher(Protocol):
    """Runs routed tokens through the experts, wherever they live, and returns the combined output."""

    def __call__(
        self,
        x: Tensor,
        topk_idx: Tensor,
        topk_weights: Tensor,
        experts: GroupedExperts,
        has_dropped: bool = False,
    ) -> Tensor:
        """Compute ``sum_j topk_weights[t, j] * expert_{topk_idx[t, j]}(x[t])`` for every token.

        Args:
            x: ``[T, H]`` local tokens.
            topk_idx: ``[T, k]`` global expert ids; ``E`` marks a dropped assignment.
            topk_weights: ``[T, k]`` combine weights (input dtype).
            experts: The (possibly expert-sharded) experts.
            has_dropped: Whether ``topk_idx`` may hold the dropped sentinel.

        Returns:
            ``[T, H]``.
        """
        ...
