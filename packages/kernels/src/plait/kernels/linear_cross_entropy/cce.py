"""The ``backend="cce"`` path: Apple's cut-cross-entropy (the ``plait-kernels[cce]`` extra)."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["cce_linear_cross_entropy"]


def cce_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    ignore_index: int,
    softcap: float | None,
    reduction: str,
) -> Any:
    """cut-cross-entropy's ``linear_cross_entropy``; ImportError naming the extra when it is missing."""
    try:
        from cut_cross_entropy import linear_cross_entropy as _cce
    except ImportError as e:
        raise ImportError(
            "linear_cross_entropy(backend='cce') needs cut-cross-entropy: pip install 'plait-kernels[cce]'"
        ) from e
    return _cce(hidden, weight, targets, ignore_index=ignore_index, softcap=softcap, reduction=reduction)
