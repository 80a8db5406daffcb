"""gpt-oss: attention with learned sinks, alternating sliding-window and full layers; every layer a
MoE of clamped-SwiGLU experts with biases, routed by a softmax over the top-k router logits."""

from __future__ import annotations

from plait.models.common import CausalLMStage, DecoderConfig, DecoderLayer, GroupedQueryAttention
from plait.models.gpt_oss.config import GptOssConfig
from plait.moe import ClampedSwiGLU, MoELayer, RouterConfig

__all__ = ["GptOssForCausalLM", "gpt_oss_layer"]


def gpt_oss_layer(config: DecoderConfig, layer_idx: int) -> DecoderLayer:
    """Decoder layer ``layer_idx`` of a gpt-oss model."""
    assert isinstance(config, GptOssConfig)
    attn = GroupedQueryAttention.from_config(
        config,
        qk_norm=False,
        sinks=True,
        sliding_window=config.sliding_window_of(layer_idx),
    )
    router = RouterConfig(
        score_func="softmax_over_topk",
        logit_bias=True,
        top_k=config.num_experts_per_tok,
        aux_loss_coef=config.router_aux_loss_coef,
        aux_loss_pooling=config.router_aux_loss_pooling,
    )
    mlp = MoELayer(
        config.hidden_size,
        config.intermediate_size,
        config.num_experts,
        router,
        expert_activation=ClampedSwiGLU(alpha=config.swiglu_alpha, limit=config.swiglu_limit),
        expert_proj_bias=True,
    )
    return DecoderLayer(layer_idx, attn, mlp, config.hidden_size, config.rms_norm_eps)


class GptOssForCausalLM(CausalLMStage):
    """gpt-oss causal LM, or one pipeline stage of it (see :class:`plait.models.CausalLMStage`).

    Args:
        config: :class:`GptOssConfig`.
        stage_index: This stage (0-based).
        num_stages: Number of pipeline stages (1 = the whole model).
        ignore_index: Label value that is not scored.
    """

    def __init__(
        self, config: GptOssConfig, *, stage_index: int = 0, num_stages: int = 1, ignore_index: int = -100
    ) -> None:
        super().__init__(
            config, gpt_oss_layer, stage_index=stage_index, num_stages=num_stages, ignore_index=ignore_index
        )
