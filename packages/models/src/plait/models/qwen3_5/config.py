"""Qwen3.5 and Qwen3-Next configurations; fields mirror transformers' ``Qwen3_5TextConfig``,
``Qwen3_5MoeTextConfig`` and ``Qwen3NextConfig``.

The three are hybrids of gated DeltaNet (``linear_attention``) and gated full-attention
(``full_attention``) layers, picked per layer by ``layer_types``; their RMSNorms store zero-centred
weights (``y = x / rms(x) * (1 + weight)``).
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from plait.models.common.config import DecoderConfig, RopeParameters, SparseStepMoE, check_finite
from plait.models.common.linear_attention import LinearAttentionImplementation
from pydantic import Field, model_validator

__all__ = ["LayerType", "Qwen3NextConfig", "Qwen3_5MoeTextConfig", "Qwen3_5TextConfig", "default_layer_types"]

LayerType = Literal["linear_attention", "full_attention"]
LAYER_TYPES: tuple[str, ...] = ("linear_attention", "full_attention")


def default_layer_types(num_layers: int, full_attention_interval: int = 4) -> tuple[str, ...]:
    """transformers' default: every ``full_attention_interval``-th layer is full attention."""
    return tuple(
        "full_attention" if (i + 1) % full_attention_interval == 0 else "linear_attention"
        for i in range(num_layers)
    )


class _HybridConfig(DecoderConfig):
    """Fields the hybrids share (the common ones: :class:`plait.models.DecoderConfig`).

    Attributes:
        linear_conv_kernel_dim: Width of the causal convolution of the linear-attention layers.
        linear_key_head_dim: Query/key head width of the linear-attention layers.
        linear_value_head_dim: Value head width of the linear-attention layers.
        linear_num_key_heads: Query/key heads of the linear-attention layers.
        linear_num_value_heads: Value heads of the linear-attention layers (a multiple of
            ``linear_num_key_heads``).
        layer_types: Per layer ``"linear_attention"`` or ``"full_attention"``; default: every fourth
            layer full attention (transformers' ``full_attention_interval=4``).
        mrope_section: Qwen3.5's multimodal RoPE sections (``rope_parameters.mrope_section``): kept
            for the export; text positions are the same on every section, so it does not change
            the text model.
        mrope_interleaved: Qwen3.5's ``rope_parameters.mrope_interleaved`` (kept for the export).
        linear_attn_implementation: plait-only: ``torch`` (plait's PyTorch gated delta rule, the
            default), ``fla`` (fla-core's kernels on CUDA: ``pip install 'plait-models[fla]'``;
            PyTorch on CPU) or ``auto`` (fla on CUDA when it is installed).
        linear_chunk_size: plait-only: tokens per chunk of the PyTorch gated delta rule.
    """

    rms_norm_offset: ClassVar[float] = 1.0
    training_only_fields: ClassVar[frozenset[str]] = DecoderConfig.training_only_fields | {
        "linear_attn_implementation",
        "linear_chunk_size",
    }

    num_key_value_heads: int | None = Field(default=2, gt=0)
    head_dim: int | None = Field(default=256, gt=0)
    max_position_embeddings: int = Field(default=32768, gt=0)
    rope_parameters: RopeParameters = RopeParameters(partial_rotary_factor=0.25)
    linear_conv_kernel_dim: int = Field(default=4, gt=0)
    linear_key_head_dim: int = Field(default=128, gt=0)
    linear_value_head_dim: int = Field(default=128, gt=0)
    linear_num_key_heads: int = Field(default=16, gt=0)
    linear_num_value_heads: int = Field(default=32, gt=0)
    layer_types: tuple[LayerType, ...] = ()
    mrope_section: tuple[int, ...] | None = None
    mrope_interleaved: bool | None = None
    linear_attn_implementation: LinearAttentionImplementation = "torch"
    linear_chunk_size: int = Field(default=64, gt=0)

    @model_validator(mode="before")
    @classmethod
    def _default_layer_types(cls, data: Any) -> Any:
        if isinstance(data, dict) and not data.get("layer_types"):
            n = data.get("num_hidden_layers", cls.model_fields["num_hidden_layers"].default)
            if isinstance(n, int) and n > 0:
                data = {**data, "layer_types": default_layer_types(n)}
        return data

    @model_validator(mode="after")
    def _check_hybrid(self) -> _HybridConfig:
        check_finite(self)
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries but num_hidden_layers={self.num_hidden_layers}"
            )
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(
                f"linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple of "
                f"linear_num_key_heads ({self.linear_num_key_heads})"
            )
        return self

    def layer_type_of(self, layer_idx: int) -> str:
        """``layer_types[layer_idx]``."""
        return self.layer_types[layer_idx]


class Qwen3_5TextConfig(_HybridConfig):
    """Qwen3.5 dense text model (``qwen3_5_text``; the language model of ``qwen3_5`` checkpoints)."""

    model_type: Literal["qwen3_5_text"] = "qwen3_5_text"
    vocab_size: int = Field(default=248320, gt=0)
    hidden_size: int = Field(default=4096, gt=0)
    intermediate_size: int = Field(default=12288, gt=0)
    num_hidden_layers: int = Field(default=32, gt=0)
    num_attention_heads: int = Field(default=16, gt=0)
    num_key_value_heads: int | None = Field(default=4, gt=0)

    @model_validator(mode="before")
    @classmethod
    def _vision_language_type(cls, data: Any) -> Any:
        # A [model] section may name the vision-language model type; plait builds its text model.
        if isinstance(data, dict) and data.get("model_type") == "qwen3_5":
            data = {**data, "model_type": "qwen3_5_text"}
        return data


class Qwen3NextConfig(SparseStepMoE, _HybridConfig):
    """Qwen3-Next (``qwen3_next``): MoE layers with a gated shared expert where
    ``is_moe_layer`` says, dense SwiGLU layers elsewhere (the routing fields:
    :class:`plait.models.common.config.SparseStepMoE`).

    Attributes:
        shared_expert_intermediate_size: SwiGLU width of the shared expert (its output is scaled
            by ``sigmoid(shared_expert_gate(x))``).
    """

    model_type: Literal["qwen3_next", "qwen3_5_moe_text"] = "qwen3_next"
    vocab_size: int = Field(default=151936, gt=0)
    hidden_size: int = Field(default=2048, gt=0)
    intermediate_size: int = Field(default=5632, gt=0)
    num_hidden_layers: int = Field(default=48, gt=0)
    num_attention_heads: int = Field(default=16, gt=0)
    moe_intermediate_size: int = Field(default=512, gt=0)
    shared_expert_intermediate_size: int = Field(default=512, gt=0)
    num_experts: int = Field(default=512, ge=0)
    num_experts_per_tok: int = Field(default=10, gt=0)
    norm_topk_prob: bool = True


class Qwen3_5MoeTextConfig(Qwen3NextConfig):
    """Qwen3.5 MoE text model (``qwen3_5_moe_text``; the language model of ``qwen3_5_moe``
    checkpoints): every layer MoE, top-k weights renormalised (transformers has no
    ``norm_topk_prob``, ``decoder_sparse_step``, ``mlp_only_layers`` or ``intermediate_size`` for it:
    they must keep these values)."""

    model_type: Literal["qwen3_next", "qwen3_5_moe_text"] = "qwen3_5_moe_text"
    vocab_size: int = Field(default=248320, gt=0)
    num_hidden_layers: int = Field(default=40, gt=0)
    num_experts: int = Field(default=256, gt=0)
    num_experts_per_tok: int = Field(default=8, gt=0)

    @model_validator(mode="before")
    @classmethod
    def _vision_language_type(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("model_type") == "qwen3_5_moe":
            data = {**data, "model_type": "qwen3_5_moe_text"}
        return data

    @model_validator(mode="after")
    def _check_every_layer_moe(self) -> Qwen3_5MoeTextConfig:
        if self.model_type != "qwen3_5_moe_text":
            raise ValueError(f"model_type must be 'qwen3_5_moe_text', got {self.model_type!r}")
        if not self.norm_topk_prob:
            raise ValueError(
                "norm_topk_prob must be True for qwen3_5_moe_text (its router always renormalises)"
            )
        if self.decoder_sparse_step != 1 or self.mlp_only_layers:
            raise ValueError(
                "decoder_sparse_step must be 1 and mlp_only_layers empty for qwen3_5_moe_text (every layer is MoE)"
            )
        return self
