"""Llama 3 / 3.1 / 3.2 configuration; fields mirror transformers' ``LlamaConfig``."""

from __future__ import annotations

from typing import Literal

from plait.models.common.config import DecoderConfig
from pydantic import Field

__all__ = ["LlamaConfig"]


class LlamaConfig(DecoderConfig):
    """Llama configuration (the shared fields: :class:`plait.models.DecoderConfig`); RoPE scaling
    ``rope_type="llama3"`` for Llama 3.1 / 3.2, any other supported RoPE variant too.

    Attributes:
        mlp_bias: Bias on the MLP's gate/up/down projections.
    """

    model_type: Literal["llama"] = "llama"
    vocab_size: int = Field(default=128256, gt=0)
    intermediate_size: int = Field(default=14336, gt=0)
    num_key_value_heads: int | None = Field(default=8, gt=0)
    rms_norm_eps: float = Field(default=1e-5, gt=0.0)
    mlp_bias: bool = False
