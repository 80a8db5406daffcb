"""The materialising reference of linear cross-entropy, and the loss reduction every path shares."""

from __future__ import annotations

from typing import Literal

import torch

__all__ = ["Reduction", "linear_cross_entropy_reference", "reduce_loss"]

Reduction = Literal["mean", "sum", "none"]


def linear_cross_entropy_reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: Reduction = "mean",
    z_loss: float = 0.0,
    softcap: float | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Materialising reference: ``logits = hidden @ weight.T`` then the same loss in fp32 (or the input's precision if higher)."""
    ct = torch.promote_types(hidden.dtype, torch.float32)
    logits = (hidden @ weight.T).to(ct)
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    lse = torch.logsumexp(logits, -1)
    valid = targets != ignore_index
    tgt = logits.gather(1, torch.where(valid, targets, 0).unsqueeze(1)).squeeze(1)
    loss = torch.where(valid, lse - tgt + z_loss * lse * lse, 0.0)
    loss = reduce_loss(loss, valid, reduction)
    return (loss, lse) if return_lse else loss


def reduce_loss(loss: torch.Tensor, valid: torch.Tensor, reduction: str) -> torch.Tensor:
    """Reduce per-token losses: ``"none"`` as is, ``"sum"``, or ``"mean"`` over the ``valid`` tokens."""
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    # Mean over non-ignored tokens; an all-ignored batch gives 0 (not NaN) so that empty
    # pipeline micro-batches do not poison the step.
    return loss.sum() / valid.sum().clamp(min=1).to(loss.dtype)


# --------------------------------------------------------------------------------------------
# Per-tile elementwise steps (PyTorch versions; Triton versions in _triton/linear_cross_entropy)
# --------------------------------------------------------------------------------------------
