"""Qwen3 and Qwen3-MoE: grouped-query attention with per-head q/k RMSNorm, SwiGLU or MoE MLPs."""

from __future__ import annotations

from plait.models.common import (
    CausalLMStage,
    DecoderConfig,
    DecoderLayer,
    GroupedQueryAttention,
    PoolingMethod,
    SequenceClassifierStage,
    SwiGLUMLP,
)
from plait.models.qwen3.config import Qwen3Config, Qwen3MoeConfig
from plait.moe import MoELayer, RouterConfig
from torch import nn

__all__ = ["Qwen3ForCausalLM", "Qwen3ForSequenceClassification", "qwen3_layer"]


def _moe(config: Qwen3MoeConfig) -> MoELayer:
    router = RouterConfig(
        score_func="softmax",
        top_k=config.num_experts_per_tok,
        norm_topk_prob=config.norm_topk_prob,
        aux_loss_coef=config.router_aux_loss_coef,
        aux_loss_pooling=config.router_aux_loss_pooling,
    )
    return MoELayer(config.hidden_size, config.moe_intermediate_size, config.num_experts, router)


def qwen3_layer(config: DecoderConfig, layer_idx: int) -> DecoderLayer:
    """Decoder layer ``layer_idx`` of a Qwen3 / Qwen3-MoE model."""
    assert isinstance(config, Qwen3Config)
    attn = GroupedQueryAttention.from_config(
        config,
        qk_norm=True,
    )
    mlp: nn.Module
    if config.is_moe_layer(layer_idx):
        assert isinstance(config, Qwen3MoeConfig)
        mlp = _moe(config)
    else:
        mlp = SwiGLUMLP(config.hidden_size, config.intermediate_size)
    return DecoderLayer(layer_idx, attn, mlp, config.hidden_size, config.rms_norm_eps)


class Qwen3ForCausalLM(CausalLMStage):
    """Qwen3 / Qwen3-MoE causal LM, or one pipeline stage of it (see :class:`CausalLMStage`).

    Args:
        config: :class:`Qwen3Config` or :class:`Qwen3MoeConfig`.
        stage_index: This stage (0-based).
        num_stages: Number of pipeline stages (1 = the whole model).
        ignore_index: Label value that is not scored.
    """

    def __init__(
        self, config: Qwen3Config, *, stage_index: int = 0, num_stages: int = 1, ignore_index: int = -100
    ) -> None:
        super().__init__(
            config, qwen3_layer, stage_index=stage_index, num_stages=num_stages, ignore_index=ignore_index
        )


class Qwen3ForSequenceClassification(SequenceClassifierStage):
    """Qwen3 / Qwen3-MoE with a ``score`` head on a pooled hidden state (HF's
    ``Qwen3ForSequenceClassification``; see :class:`SequenceClassifierStage`)."""

    def __init__(
        self,
        config: Qwen3Config,
        num_labels: int,
        *,
        pooling: PoolingMethod = "last",
        stage_index: int = 0,
        num_stages: int = 1,
    ) -> None:
        super().__init__(
            config, qwen3_layer, num_labels, pooling=pooling, stage_index=stage_index, num_stages=num_stages
        )
