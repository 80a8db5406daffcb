"""Llama: grouped-query attention (no q/k norm) and SwiGLU MLPs, optional biases."""

from __future__ import annotations

from plait.models.common import CausalLMStage, DecoderConfig, DecoderLayer, GroupedQueryAttention, SwiGLUMLP
from plait.models.llama.config import LlamaConfig

__all__ = ["LlamaForCausalLM", "llama_layer"]


def llama_layer(config: DecoderConfig, layer_idx: int) -> DecoderLayer:
    """Decoder layer ``layer_idx`` of a Llama model."""
    assert isinstance(config, LlamaConfig)
    attn = GroupedQueryAttention.from_config(
        config,
        qk_norm=False,
    )
    mlp = SwiGLUMLP(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
    return DecoderLayer(layer_idx, attn, mlp, config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(CausalLMStage):
    """Llama causal LM, or one pipeline stage of it (see :class:`plait.models.CausalLMStage`).

    Args:
        config: :class:`LlamaConfig`.
        stage_index: This stage (0-based).
        num_stages: Number of pipeline stages (1 = the whole model).
        ignore_index: Label value that is not scored.
    """

    def __init__(
        self, config: LlamaConfig, *, stage_index: int = 0, num_stages: int = 1, ignore_index: int = -100
    ) -> None:
        super().__init__(
            config, llama_layer, stage_index=stage_index, num_stages=num_stages, ignore_index=ignore_index
        )
