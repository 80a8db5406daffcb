"""Qwen3 and Qwen3-MoE configurations; fields mirror transformers' ``Qwen3Config`` / ``Qwen3MoeConfig``."""

from __future__ import annotations

from typing import Literal

from plait.models.common.config import DecoderConfig, check_finite
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


class Qwen3MoeConfig(Qwen3Config):
    """Qwen3-MoE configuration; fields mirror ``transformers.Qwen3MoeConfig``.

    Attributes:
        moe_intermediate_size: SwiGLU width of each routed expert.
        num_experts: Routed experts per MoE layer (``num_local_experts`` in ``config.json``).
        num_experts_per_tok: Top-k.
        norm_topk_prob: Renormalise the top-k routing weights to sum to 1.
        decoder_sparse_step: Layer ``i`` is sparse when ``(i + 1) % decoder_sparse_step == 0``.
        mlp_only_layers: Layers that always use a dense MLP.
        router_aux_loss_coef: Load-balancing loss coefficient.
        router_aux_loss_pooling: plait-only: ``"all_layers"`` (default, transformers'
            ``load_balancing_loss_func``): one Switch loss of the router statistics pooled over all
            MoE layers of the model; ``"per_layer"`` (Megatron-style): the sum of one Switch loss
            per MoE layer (about L times larger for L MoE layers at the same coefficient).
        output_router_logits: Accepted for compatibility (HF only adds the aux loss when set);
            plait always adds ``router_aux_loss_coef`` times the aux loss through the gradient.
    """

    model_type: Literal["qwen3", "qwen3_moe"] = "qwen3_moe"
    hidden_size: int = Field(default=2048, gt=0)
    intermediate_size: int = Field(default=6144, gt=0)
    num_hidden_layers: int = Field(default=24, gt=0)
    num_key_value_heads: int | None = 4
    moe_intermediate_size: int = Field(default=768, gt=0)
    num_experts: int = Field(default=128, ge=0)
    num_experts_per_tok: int = Field(default=8, gt=0)
    norm_topk_prob: bool = False
    decoder_sparse_step: int = Field(default=1, gt=0)
    mlp_only_layers: tuple[int, ...] = ()
    router_aux_loss_coef: float = 0.001
    router_aux_loss_pooling: Literal["all_layers", "per_layer"] = "all_layers"
    output_router_logits: bool = False

    @model_validator(mode="after")
    def _check_moe(self) -> Qwen3MoeConfig:
        check_finite(self)
        if self.num_experts and self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) > num_experts ({self.num_experts})"
            )
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
        if bad:
            raise ValueError(f"mlp_only_layers has indices outside [0, num_hidden_layers): {bad}")
        return self

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Same rule as ``Qwen3MoeDecoderLayer``: not in ``mlp_only_layers`` and on the sparse step."""
        return (
            layer_idx not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer_idx + 1) % self.decoder_sparse_step == 0
        )

    def pooled_router_aux_loss_coef(self) -> float | None:
        """``router_aux_loss_coef`` with ``router_aux_loss_pooling="all_layers"``, else None."""
        return self.router_aux_loss_coef if self.router_aux_loss_pooling == "all_layers" else None
