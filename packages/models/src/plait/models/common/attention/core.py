"""The attention call every attention module makes: one mask, the kernel it was built for."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from plait.models.common.attention.context import context_attention
from plait.models.common.attention.kernels import apply_sinks, flash, sink_reference_attention
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
    if mask.backend == "flex" and mask.block_mask is not None:
        if sinks is None:
            out = mask.kernels.flex(qt, kt, vt, mask.block_mask, scale)
        else:
            out, lse = mask.kernels.flex(qt, kt, vt, mask.block_mask, scale, return_lse=True)
            out = apply_sinks(out, lse, sinks)
    elif sinks is not None:
        out = sink_reference_attention(qt, kt, vt, mask.dense_mask, scale, sinks)
    else:
        gqa = qt.shape[1] != kt.shape[1]
        if mask.dense_mask is not None:
            out = F.scaled_dot_product_attention(
                qt, kt, vt, attn_mask=mask.dense_mask, scale=scale, enable_gqa=gqa
            )
        else:
            out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=gqa)
    return out.transpose(1, 2)
