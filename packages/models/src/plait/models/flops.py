"""Training FLOPs per token of any family's model (for MFU)."""

from __future__ import annotations

from plait.models.common.config import DecoderConfig
from plait.models.registry import family_of

__all__ = ["flops_per_token"]


def flops_per_token(config: DecoderConfig, seq_len: int) -> float:
    """Forward + backward FLOPs per token: ``6 * active_params`` plus attention, counted without the
    causal halving (the PaLM / torchtitan convention; see :mod:`plait.models.common.flops`)."""
    return family_of(config).flops_per_token(config, seq_len)
