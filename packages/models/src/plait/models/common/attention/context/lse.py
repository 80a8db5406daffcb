"""The log-sum-exp rule that merges partial softmax results (ring blocks, per-chunk kernels)."""

from __future__ import annotations

import torch

__all__ = ["merge_lse"]


def merge_lse(
    out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two partial softmax results by the log-sum-exp rule (rows with no keys stay 0)."""
    new = torch.logaddexp(lse, block_lse)
    ref = torch.where(torch.isinf(new), torch.zeros_like(new), new)
    out = out * torch.exp(lse - ref)[..., None] + block_out * torch.exp(block_lse - ref)[..., None]
    return out, new
