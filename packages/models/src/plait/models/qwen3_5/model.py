"""Qwen3.5 / Qwen3-Next: gated DeltaNet and gated full-attention layers (per ``layer_types``) with
zero-centred RMSNorms; SwiGLU MLPs or MoE blocks with a sigmoid-gated shared expert."""

from __future__ import annotations

from plait.models.common import CausalLMStage, DecoderConfig, DecoderLayer, GroupedQueryAttention, SwiGLUMLP
from plait.models.common.linear_attention import GatedDeltaNet
from plait.models.qwen3_5.config import Qwen3NextConfig, _HybridConfig
from plait.moe import MoELayer, RouterConfig
from torch import nn

__all__ = ["Qwen3_5ForCausalLM", "qwen3_5_layer"]


def _moe(config: Qwen3NextConfig) -> MoELayer:
    router = RouterConfig(
        score_func="softmax",
        top_k=config.num_experts_per_tok,
        norm_topk_prob=config.norm_topk_prob,
        aux_loss_coef=config.router_aux_loss_coef,
        aux_loss_pooling=config.router_aux_loss_pooling,
    )
    return MoELayer(
        config.hidden_size,
        config.moe_intermediate_size,
        config.num_experts,
        router,
        shared_expert_intermediate_size=config.shared_expert_intermediate_size,
        shared_expert_gate=True,
    )


def _linear_attention(config: _HybridConfig, layer_idx: int) -> GatedDeltaNet:
    return GatedDeltaNet(
        config.hidden_size,
        config.linear_num_key_heads,
        config.linear_num_value_heads,
        config.linear_key_head_dim,
        config.linear_value_head_dim,
        config.linear_conv_kernel_dim,
        config.rms_norm_eps,
        layout="grouped" if config.model_type == "qwen3_next" else "split",
        chunk_size=config.linear_chunk_size,
        implementation=config.linear_attn_implementation,
        layer_idx=layer_idx,
    )


def qwen3_5_layer(config: DecoderConfig, layer_idx: int) -> DecoderLayer:
    """Decoder layer ``layer_idx``: its token mixer from ``layer_types`` (a :class:`GatedDeltaNet`
    or gated :class:`GroupedQueryAttention`, both in the ``self_attn`` slot), a MoE block where
    ``is_moe_layer`` says, else a SwiGLU MLP."""
    assert isinstance(config, _HybridConfig)
    mixer: nn.Module
    if config.layer_type_of(layer_idx) == "linear_attention":
        mixer = _linear_attention(config, layer_idx)
    else:
        mixer = GroupedQueryAttention.from_config(config, qk_norm=True, output_gate=True)
    mlp: nn.Module
    if config.is_moe_layer(layer_idx):
        assert isinstance(config, Qwen3NextConfig)
        mlp = _moe(config)
    else:
        mlp = SwiGLUMLP(config.hidden_size, config.intermediate_size)
    return DecoderLayer(
        layer_idx, mixer, mlp, config.hidden_size, config.rms_norm_eps, config.rms_norm_offset
    )


class Qwen3_5ForCausalLM(CausalLMStage):
    """Qwen3.5 (dense or MoE) / Qwen3-Next causal LM, or one pipeline stage of it (see
    :class:`CausalLMStage`).

    Args:
        config: :class:`Qwen3_5TextConfig`, :class:`Qwen3_5MoeTextConfig` or :class:`Qwen3NextConfig`.
        stage_index: This stage (0-based).
        num_stages: Number of pipeline stages (1 = the whole model).
        ignore_index: Label value that is not scored.
    """

    def __init__(
        self, config: _HybridConfig, *, stage_index: int = 0, num_stages: int = 1, ignore_index: int = -100
    ) -> None:
        super().__init__(
            config, qwen3_5_layer, stage_index=stage_index, num_stages=num_stages, ignore_index=ignore_index
        )
