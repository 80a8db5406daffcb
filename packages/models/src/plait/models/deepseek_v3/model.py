"""DeepSeek-V3: multi-head latent attention; dense SwiGLU layers, then MoE layers with sigmoid,
group-limited routing, a selection-only correction bias and shared experts."""

from __future__ import annotations

from plait.models.common import CausalLMStage, DecoderConfig, DecoderLayer, SwiGLUMLP
from plait.models.deepseek_v3.attention import MultiHeadLatentAttention
from plait.models.deepseek_v3.config import DeepseekV3Config
from plait.moe import MoELayer, RouterConfig
from torch import nn

__all__ = ["DeepseekV3ForCausalLM", "deepseek_v3_layer", "deepseek_v3_router"]


def deepseek_v3_router(config: DeepseekV3Config) -> RouterConfig:
    """DeepSeek-V3's routing as a :class:`plait.moe.RouterConfig`: sigmoid scores (fp32 logits),
    groups scored by their two best biased scores, the correction bias (``router.expert_bias``) for
    selection only, ``norm_topk_prob``, ``routed_scaling_factor``; the bias trained the
    auxiliary-loss-free way when ``bias_update_rate`` is set."""
    return RouterConfig(
        score_func="sigmoid",
        fp32_logits=True,
        top_k=config.num_experts_per_tok,
        norm_topk_prob=config.norm_topk_prob,
        scaling_factor=config.routed_scaling_factor,
        n_groups=config.n_group,
        topk_groups=config.topk_group,
        group_score="top2_sum",
        selection_bias=True,
        bias_update_rate=config.bias_update_rate,
        seq_aux_loss_coef=config.seq_aux_loss_coef,
    )


def deepseek_v3_layer(config: DecoderConfig, layer_idx: int) -> DecoderLayer:
    """Decoder layer ``layer_idx`` of a DeepSeek-V3 model."""
    assert isinstance(config, DeepseekV3Config)
    mlp: nn.Module
    if config.is_moe_layer(layer_idx):
        shared = config.n_shared_experts * config.moe_intermediate_size
        mlp = MoELayer(
            config.hidden_size,
            config.moe_intermediate_size,
            config.n_routed_experts,
            deepseek_v3_router(config),
            shared_expert_intermediate_size=shared or None,
        )
    else:
        mlp = SwiGLUMLP(config.hidden_size, config.intermediate_size)
    attn = MultiHeadLatentAttention(config)
    return DecoderLayer(layer_idx, attn, mlp, config.hidden_size, config.rms_norm_eps)


class DeepseekV3ForCausalLM(CausalLMStage):
    """DeepSeek-V3 causal LM, or one pipeline stage of it (see :class:`plait.models.CausalLMStage`).

    Args:
        config: :class:`DeepseekV3Config`.
        stage_index: This stage (0-based).
        num_stages: Number of pipeline stages (1 = the whole model).
        ignore_index: Label value that is not scored.
    """

    def __init__(
        self,
        config: DeepseekV3Config,
        *,
        stage_index: int = 0,
        num_stages: int = 1,
        ignore_index: int = -100,
    ) -> None:
        super().__init__(
            config,
            deepseek_v3_layer,
            stage_index=stage_index,
            num_stages=num_stages,
            ignore_index=ignore_index,
        )
