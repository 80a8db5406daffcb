"""Qwen3 and Qwen3-MoE configurations; fields mirror transformers' ``Qwen3Config`` / ``Qwen3MoeConfig``."""

from __future__ import annotations

from typing import Literal

from plait.models.common.config import DecoderConfig, SparseStepMoE
from pydantic import Field, model_validator

__all__ = ["Qwen3Config", "Qwen3MoeConfig"]


class Qwen3Config(DecoderConfig):
    """Qwen3 (dense) configuration (the shared fields: :class:`plait.models.DecoderConfig`).

    Attributes:
        use_sliding_window: Must be False (Qwen3 checkpoints train with full attention).
    """

    model_type: Literal["qwen3", "qwen3_moe"] = "qwen3"
    vocab_size: int = Field(default=151936, gt=0)
    intermediate_size: int = Field(default=22016, gt=0)
    max_position_embeddings: int = Field(default=32768, gt=0)
    use_sliding_window: bool = False

    @model_validator(mode="after")
    def _check(self) -> Qwen3Config:
        if self.use_sliding_window:
            raise ValueError("use_sliding_window=True is not supported by plait's Qwen3")
        return self


class Qwen3MoeConfig(SparseStepMoE, Qwen3Config):
    """Qwen3-MoE configuration; fields mirror ``transformers.Qwen3MoeConfig`` (the routing fields:
    :class:`plait.models.common.config.SparseStepMoE`)."""

    model_type: Literal["qwen3", "qwen3_moe"] = "qwen3_moe"
    hidden_size: int = Field(default=2048, gt=0)
    intermediate_size: int = Field(default=6144, gt=0)
    num_hidden_layers: int = Field(default=24, gt=0)
    num_key_value_heads: int | None = 4
