"""Expert capacity: drop assignments beyond ``ceil(capacity_factor * T * k / E)`` per expert."""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

DropPolicy = Literal["probs", "position"]


def expert_capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """Slots per expert for ``num_tokens`` local tokens."""
    return math.ceil(capacity_factor * num_tokens * top_k / num_experts)


def apply_capacity(
    topk_idx: Tensor,
    topk_weights: Tensor,
    num_experts: int,
    capacity_factor: float,
    policy: DropPolicy = "probs",
) -> Tensor:
    """Mark assignments over an expert's capacity as dropped.

    Args:
        topk_idx: ``[T, k]`` chosen experts.
        topk_weights: ``[T, k]`` their weights (the ``"probs"`` policy keeps the heaviest).
        num_experts: E.
        capacity_factor: Slots per expert as a multiple of the balanced load ``T * k / E``.
        policy: ``"probs"`` keeps each expert's highest-weight assignments, ``"position"`` its
            earliest tokens. Ties keep token order.

    Returns:
        ``topk_idx`` with dropped assignments set to ``num_experts`` (the sentinel the dispatchers
        skip). A dropped assignment contributes nothing; the kept weights are not renormalised.
    """
    if policy not in ("probs", "position"):
        raise ValueError(f"drop_policy must be 'probs' or 'position', got {policy!r}")
    num_tokens, top_k = topk_idx.shape
    cap = expert_capacity(num_tokens, top_k, num_experts, capacity_factor)
    flat = topk_idx.reshape(-1)
    if policy == "probs":
        # Two stable sorts: by weight descending, then by expert -> each expert's rows by weight.
        order = torch.sort(topk_weights.detach().reshape(-1).float(), descending=True, stable=True).indices
        order = order[torch.sort(flat[order], stable=True).indices]
    else:
        order = torch.sort(flat, stable=True).indices
    sorted_e = flat[order]
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    starts = torch.cumsum(counts, 0) - counts
    rank_in_expert = torch.arange(flat.numel(), device=flat.device) - starts[sorted_e]
    keep_sorted = rank_in_expert < cap
    keep = torch.empty_like(keep_sorted).index_copy_(0, order, keep_sorted)
    return torch.where(keep, flat, torch.full_like(flat, num_experts)).view(num_tokens, top_k)
