"""The attention call every attention module makes: one mask, the kernel it was built for."""

from __future__ import annotations

import torch
from plait.models.common.attention.context import context_attention
from plait.models.common.attention.kernels import flash, masked_attention
from plait.models.common.attention.mask import AttentionMask

__all__ = ["attention"]


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: AttentionMask,
    scale: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal (document-masked, windowed) attention of ``[B, S, heads, D]`` tensors.

    k/v may have fewer heads than q (grouped-query attention) and v another head size than q/k.

    Args:
        q: Queries.
        k: Keys.
        v: Values.
        mask: This forward's mask (:func:`plait.models.common.attention.build_attention_mask`).
        scale: Softmax scale.
        sinks: ``[q_heads]`` sink logits (gpt-oss), or None.

    Returns:
        ``[B, S, q_heads, Dv]``.
    """
    if mask.context is not None:
        return context_attention(q, k, v, mask, scale, sinks)
    if mask.backend == "flash":
        return flash(q, k, v, scale, mask.cu_seqlens, mask.max_seqlen, mask.sliding_window)
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    block = mask.block_mask if mask.backend == "flex" else None
    out = masked_attention(
        qt, kt, vt, scale, kernels=mask.kernels, block_mask=block, dense_mask=mask.dense_mask, sinks=sinks
    )
    return out.transpose(1, 2)
