"""Qwen3 and Qwen3-MoE models."""

from plait.models.qwen3.layers import Qwen3DecoderLayer
from plait.models.qwen3.model import (
    Qwen3ForCausalLM,
    Qwen3ForSequenceClassification,
    Qwen3Model,
    Qwen3Stage,
    stage_layer_ids,
)

__all__ = [
    "Qwen3DecoderLayer",
    "Qwen3ForCausalLM",
    "Qwen3ForSequenceClassification",
    "Qwen3Model",
    "Qwen3Stage",
    "stage_layer_ids",
]
