"""gpt-oss configuration; fields mirror transformers' ``GptOssConfig``."""

from __future__ import annotations

from typing import Literal

from plait.models.common.config import DecoderConfig, RopeParameters, check_finite
from pydantic import Field, model_validator

__all__ = ["GptOssConfig", "LayerType"]

LayerType = Literal["sliding_attention", "full_attention"]

_YARN = RopeParameters(
    rope_type="yarn",
    rope_theta=150000.0,
    factor=32.0,
    beta_fast=32.0,
    beta_slow=1.0,
    truncate=False,
    original_max_position_embeddings=4096,
)


class GptOssConfig(DecoderConfig):
    """gpt-oss configuration (the shared fields: :class:`plait.models.DecoderConfig`).

    Every layer is a MoE layer; attention has learned sinks per head and alternates sliding-window
    and full layers.

    Attributes:
        num_experts: Routed experts per layer (``num_local_experts`` in ``config.json``).
        num_experts_per_tok: Top-k (softmax over the k selected router logits).
        sliding_window: Keys a sliding-window layer's query sees (itself included).
        layer_types: Per layer ``sliding_attention`` or ``full_attention``; default: sliding on even
            layers, full on odd ones (transformers' default).
        swiglu_alpha: Sigmoid gain of the experts' clamped SwiGLU.
        swiglu_limit: Clamp of the gate (above) and of up (both sides) in that SwiGLU.
        router_aux_loss_coef: Load-balancing (Switch) loss coefficient.
        router_aux_loss_pooling: plait-only: ``all_layers`` (transformers': one Switch loss of the
            statistics pooled over all layers) or ``per_layer``.
        output_router_logits: Accepted for compatibility (plait always adds the weighted aux loss).
    """

    model_type: Literal["gpt_oss"] = "gpt_oss"
    vocab_size: int = Field(default=201088, gt=0)
    hidden_size: int = Field(default=2880, gt=0)
    intermediate_size: int = Field(default=2880, gt=0)
    num_hidden_layers: int = Field(default=36, gt=0)
    num_attention_heads: int = Field(default=64, gt=0)
    num_key_value_heads: int | None = Field(default=8, gt=0)
    head_dim: int | None = Field(default=64, gt=0)
    max_position_embeddings: int = Field(default=131072, gt=0)
    rms_norm_eps: float = Field(default=1e-5, gt=0.0)
    rope_parameters: RopeParameters = _YARN
    attention_bias: bool = True
    num_experts: int = Field(default=128, gt=0)
    num_experts_per_tok: int = Field(default=4, gt=0)
    sliding_window: int | None = Field(default=128, gt=0)
    layer_types: tuple[LayerType, ...] | None = None
    swiglu_alpha: float = Field(default=1.702, gt=0.0)
    swiglu_limit: float = Field(default=7.0, gt=0.0)
    router_aux_loss_coef: float = Field(default=0.001, ge=0.0)
    router_aux_loss_pooling: Literal["all_layers", "per_layer"] = "all_layers"
    output_router_logits: bool = False

    @model_validator(mode="after")
    def _check_gpt_oss(self) -> GptOssConfig:
        check_finite(self)
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) > num_experts ({self.num_experts})"
            )
        types = self.resolved_layer_types
        if len(types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(types)} entries, num_hidden_layers={self.num_hidden_layers}"
            )
        if "sliding_attention" in types and self.sliding_window is None:
            raise ValueError("layer_types has sliding_attention layers but sliding_window is None")
        return self

    @property
    def resolved_layer_types(self) -> tuple[LayerType, ...]:
        """``layer_types``, or transformers' default (sliding on even layers, full on odd ones)."""
        if self.layer_types is not None:
            return self.layer_types
        return tuple(
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(self.num_hidden_layers)
        )

    @property
    def moe_intermediate_size(self) -> int:
        """Each expert's SwiGLU width (gpt-oss's ``intermediate_size``)."""
        return self.intermediate_size

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Every gpt-oss layer is a MoE layer."""
        del layer_idx
        return True

    def sliding_window_of(self, layer_idx: int) -> int | None:
        """``sliding_window`` for ``sliding_attention`` layers, None for ``full_attention`` ones."""
        kind = (
            self.layer_types[layer_idx]
            if self.layer_types is not None
            else ("full_attention", "sliding_attention")[layer_idx % 2 == 0]
        )
        return self.sliding_window if kind == "sliding_attention" else None

    def pooled_router_aux_loss_coef(self) -> float | None:
        """``router_aux_loss_coef`` with ``router_aux_loss_pooling="all_layers"``, else None."""
        return self.router_aux_loss_coef if self.router_aux_loss_pooling == "all_layers" else None
