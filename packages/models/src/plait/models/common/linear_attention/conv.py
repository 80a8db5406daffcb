"""Short causal depthwise convolution over packed documents (gated DeltaNet's q/k/v mixing)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["causal_conv1d"]


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, document_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """``out[t, c] = sum_i weight[c, K-1-i] * x[t-i, c]`` over the ``K`` latest tokens of ``t``'s own
    document (earlier positions and other documents count as zeros), computed in ``weight``'s dtype.

    Args:
        x: ``[B, S, C]``.
        weight: ``[C, K]`` (``nn.Conv1d(C, C, K, groups=C).weight[:, 0]``).
        document_ids: ``[B, S]`` ids of packed documents, or None (one document per row).

    Returns:
        ``[B, S, C]`` in ``x``'s dtype (no activation).
    """
    seq, width = x.shape[1], weight.shape[-1]
    xw = x.to(weight.dtype)
    if document_ids is None:
        out = F.conv1d(xw.transpose(1, 2), weight.unsqueeze(1), padding=width - 1, groups=weight.shape[0])
        return out[..., :seq].transpose(1, 2).to(x.dtype)
    docs = document_ids.to(x.device)
    out = xw * weight[:, width - 1]
    for i in range(1, min(width, seq + 1)):
        shifted = F.pad(xw, (0, 0, i, 0))[:, :seq]  # x[t - i]
        same = F.pad(docs, (i, 0), value=-1)[:, :seq] == docs  # t - i in t's document
        out = out + shifted * same.unsqueeze(-1).to(xw.dtype) * weight[:, width - 1 - i]
    return out.to(x.dtype)
