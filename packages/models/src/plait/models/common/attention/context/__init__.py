"""Context parallelism: the sequence is split over the ranks of a context group.

Every rank holds two chunks of each row in the load-balanced layout of
:mod:`plait.dist_core.context_parallel` (chunks ``i`` and ``2n-1-i`` of ``2n``). Projections,
q/k norms, RoPE (with global positions) and the MLP are per token and run on the local tokens;
only attention needs the other ranks' keys and values. Two ways, chosen by ``mode``:
``"allgather"`` (:mod:`.allgather`, Llama 3's) and ``"ring"`` (:mod:`.ring`). Attention whose K/V
are expanded from a narrower per-token latent (multi-head latent attention) can all-gather the
latent instead (:func:`allgather_latent_attention`).

Packed documents: document ids (given, or derived from position ids that restart) are
all-gathered once per forward, so a document that crosses chunk or rank boundaries is masked as
in the single-process model. Padding (``attention_mask``) is all-gathered the same way and every
padding token of the full row becomes a one-token document, as in the single-process mask. A
sliding window and attention sinks are honoured in both modes.
"""

from __future__ import annotations

import torch
from plait.models.common.attention.context.allgather import allgather_attention, allgather_latent_attention
from plait.models.common.attention.context.group import (
    ContextParallel,
    ContextParallelMask,
    ContextParallelMode,
)
from plait.models.common.attention.context.ring import ring_attention
from plait.models.common.attention.kernels import apply_sinks
from plait.models.common.attention.mask import AttentionMask

__all__ = [
    "ContextParallel",
    "ContextParallelMask",
    "ContextParallelMode",
    "allgather_latent_attention",
    "context_attention",
]


def context_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: AttentionMask,
    scale: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of local ``q [B, S, Hq, D]`` to the whole sequence's ``k, v [B, S, Hkv, D]``.

    Returns ``[B, S, Hq, Dv]``.
    """
    cp = mask.context
    assert cp is not None
    if cp.mode == "ring":
        out, lse = ring_attention(q, k, v, cp, scale)
        if sinks is None:
            return out
        return apply_sinks(out.transpose(1, 2), lse, sinks).transpose(1, 2)
    return allgather_attention(q, k, v, mask, scale, cp, sinks)
