"""Configuration shared by every family: RoPE parameters and the decoder fields all families have.

Field names follow the Hugging Face configs so a ``config.json`` maps onto them key for key (see
:mod:`plait.models.common.hf.config`). Fields only plait uses (``attn_implementation``) are never
written to ``config.json``. Every float that scales the numerics must be finite.
"""

from __future__ import annotations

import math
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["AttentionImplementation", "DecoderConfig", "RopeParameters", "SparseStepMoE"]

AttentionImplementation = Literal["auto", "sdpa", "flex", "flash"]


def check_finite(model: BaseModel) -> None:
    """Raise naming the first float field of ``model`` that is NaN or infinite."""
    for name, value in model:
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{name}={value} must be a finite number")


class RopeParameters(BaseModel):
    """Rotary position embedding parameters (transformers 5.x ``rope_parameters``).

    Attributes:
        rope_type: ``default``, ``linear`` (position interpolation), ``dynamic`` (dynamic NTK),
            ``yarn`` or ``llama3`` (Llama 3.1's frequency-band scaling).
        rope_theta: Base wavelength.
        factor: Context-extension factor (``linear``, ``dynamic``, ``yarn``, ``llama3``).
        original_max_position_embeddings: Pre-training context length (``yarn``, ``llama3``).
        attention_factor: YaRN cos/sin scale; inferred from ``factor`` (and ``mscale``) if None.
        beta_fast: YaRN extrapolation boundary (default 32).
        beta_slow: YaRN interpolation boundary (default 1).
        mscale: YaRN ``mscale`` (DeepSeek style attention factor).
        mscale_all_dim: YaRN ``mscale_all_dim``.
        truncate: YaRN: round the correction range to whole dimensions.
        low_freq_factor: ``llama3``: wavelengths above ``original / low_freq_factor`` are scaled.
        high_freq_factor: ``llama3``: wavelengths below ``original / high_freq_factor`` are kept.
        partial_rotary_factor: Fraction of each head's dimensions that are rotated.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    rope_type: Literal["default", "linear", "dynamic", "yarn", "llama3"] = "default"
    rope_theta: float = Field(default=10000.0, gt=0.0)
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    attention_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    partial_rotary_factor: float = Field(default=1.0, gt=0.0, le=1.0)

    @model_validator(mode="after")
    def _check(self) -> RopeParameters:
        check_finite(self)
        kind = self.rope_type
        if kind in ("linear", "dynamic", "llama3") and self.factor is None:
            raise ValueError(f"rope_parameters.factor is required for rope_type={kind!r}")
        if kind in ("yarn", "llama3") and self.original_max_position_embeddings is None:
            raise ValueError(
                f"rope_parameters.original_max_position_embeddings is required for rope_type={kind!r}"
            )
        if kind == "llama3":
            if self.low_freq_factor is None or self.high_freq_factor is None:
                raise ValueError(
                    "rope_parameters.low_freq_factor and high_freq_factor are required for rope_type='llama3'"
                )
            if self.high_freq_factor <= self.low_freq_factor:
                raise ValueError(
                    f"rope_parameters.high_freq_factor={self.high_freq_factor} must be > "
                    f"low_freq_factor={self.low_freq_factor}"
                )
        return self


class DecoderConfig(BaseModel):
    """The fields every decoder-only family shares (names as in Hugging Face's configs).

    Attributes:
        model_type: Hugging Face ``model_type``; picks the family (each family narrows it).
        vocab_size: Vocabulary size.
        hidden_size: Model width.
        intermediate_size: SwiGLU hidden width of dense MLPs.
        num_hidden_layers: Number of decoder layers.
        num_attention_heads: Query heads.
        num_key_value_heads: Key/value heads (grouped-query attention); defaults to the query heads.
        head_dim: Per-head width; defaults to ``hidden_size // num_attention_heads``.
        hidden_act: Only ``silu`` (SwiGLU) is supported.
        max_position_embeddings: Context length (used by dynamic NTK / YaRN).
        initializer_range: Std of the normal init of linear and embedding weights.
        rms_norm_eps: RMSNorm epsilon.
        tie_word_embeddings: Share the embedding matrix with the LM head.
        rope_parameters: RoPE settings (theta and scaling).
        attention_bias: Bias on the q/k/v/o projections.
        attention_dropout: Must be 0 (plait trains without attention dropout).
        pad_token_id: Padding token (embedding ``padding_idx``; last-token pooling).
        bos_token_id: Beginning-of-sequence token (metadata only).
        eos_token_id: End-of-sequence token(s) (metadata only).
        attn_implementation: plait-only: attention backend (``auto`` picks FlashAttention when it
            is installed and the inputs are on CUDA in half precision, else SDPA, FlexAttention for
            packed documents on CUDA).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")
    # Fields that change how a checkpoint trains, not what it computes: a run may set them over a
    # checkpoint's config.json (the main job's --init-from logs each override).
    training_only_fields: ClassVar[frozenset[str]] = frozenset(
        {
            "attn_implementation",
            "initializer_range",
            "router_aux_loss_coef",
            "router_aux_loss_pooling",
            "output_router_logits",
            "max_position_embeddings",
        }
    )
    # The weight offset of the model's RMSNorms (1.0: zero-centred weights; see RMSNorm).
    rms_norm_offset: ClassVar[float] = 0.0

    model_type: str
    vocab_size: int = Field(default=32000, gt=0)
    hidden_size: int = Field(default=4096, gt=0)
    intermediate_size: int = Field(default=11008, gt=0)
    num_hidden_layers: int = Field(default=32, gt=0)
    num_attention_heads: int = Field(default=32, gt=0)
    num_key_value_heads: int | None = Field(default=None, gt=0)
    head_dim: int | None = Field(default=None, gt=0)
    hidden_act: Literal["silu"] = "silu"
    max_position_embeddings: int = Field(default=8192, gt=0)
    initializer_range: float = Field(default=0.02, ge=0.0)
    rms_norm_eps: float = Field(default=1e-6, gt=0.0)
    tie_word_embeddings: bool = False
    rope_parameters: RopeParameters = RopeParameters()
    attention_bias: bool = False
    attention_dropout: float = 0.0
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    attn_implementation: AttentionImplementation = "auto"

    @model_validator(mode="after")
    def _check_decoder(self) -> DecoderConfig:
        check_finite(self)
        if self.num_attention_heads % self.kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.kv_heads})"
            )
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ValueError("head_dim is None and hidden_size is not divisible by num_attention_heads")
        if self.attention_dropout != 0.0:
            raise ValueError("attention_dropout must be 0.0: plait does not implement attention dropout")
        rot = self.rope_head_dim * self.rope_parameters.partial_rotary_factor
        if int(rot) % 2:
            raise ValueError(f"rotary dimension {int(rot)} (head_dim x partial_rotary_factor) must be even")
        return self

    @property
    def kv_heads(self) -> int:
        """Number of key/value heads (``num_key_value_heads`` or the query head count)."""
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def resolved_head_dim(self) -> int:
        """Per-head width (``head_dim`` or ``hidden_size // num_attention_heads``)."""
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def rope_head_dim(self) -> int:
        """Width of the per-head vectors RoPE rotates (a family with decoupled rope keys narrows it)."""
        return self.resolved_head_dim

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether decoder layer ``layer_idx`` uses a sparse MoE block (dense families: never)."""
        del layer_idx
        return False

    def layer_type_of(self, layer_idx: int) -> str:
        """The token mixer of layer ``layer_idx`` (hybrid families: e.g. ``"linear_attention"``)."""
        del layer_idx
        return "full_attention"

    def sliding_window_of(self, layer_idx: int) -> int | None:
        """The sliding window of layer ``layer_idx`` (None: full attention; dense families: always)."""
        del layer_idx
        return None

    def pooled_router_aux_loss_coef(self) -> float | None:
        """Coefficient of a Switch loss pooled over all MoE layers, or None (dense, or per-layer losses)."""
        return None


class SparseStepMoE(BaseModel):
    """Routed experts on a sparse step: the MoE fields and the layer rule of transformers' Qwen MoE configs
    (Qwen3-MoE, Qwen3-Next, Qwen3.5-MoE), mixed into a family's config ahead of its decoder fields
    (``class C(SparseStepMoE, Decoder...)``); each family sets its own defaults of the sizes.

    Attributes:
        moe_intermediate_size: SwiGLU width of each routed expert.
        num_experts: Routed experts per MoE layer (0: every layer dense).
        num_experts_per_tok: Top-k.
        norm_topk_prob: Renormalise the top-k routing weights to sum to 1.
        decoder_sparse_step: Layer ``i`` is sparse when ``(i + 1) % decoder_sparse_step == 0``.
        mlp_only_layers: Layers that always use a dense MLP.
        router_aux_loss_coef: Load-balancing loss coefficient.
        router_aux_loss_pooling: plait-only: ``"all_layers"`` (default, transformers'
            ``load_balancing_loss_func``): one Switch loss of the router statistics pooled over all
            MoE layers of the model; ``"per_layer"`` (Megatron-style): the sum of one Switch loss
            per MoE layer (about L times larger for L MoE layers at the same coefficient).
        output_router_logits: Accepted for compatibility (Hugging Face adds the aux loss only when set);
            plait always adds ``router_aux_loss_coef`` times the aux loss through the gradient.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

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
    def _check_moe(self) -> SparseStepMoE:
        check_finite(self)
        if self.num_experts and self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) > num_experts ({self.num_experts})"
            )
        bad = [i for i in self.mlp_only_layers if not 0 <= i < getattr(self, "num_hidden_layers", 0)]
        if bad:
            raise ValueError(f"mlp_only_layers has indices outside [0, num_hidden_layers): {bad}")
        return self

    def is_moe_layer(self, layer_idx: int) -> bool:
        """transformers' rule: not in ``mlp_only_layers`` and on the sparse step."""
        return (
            layer_idx not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer_idx + 1) % self.decoder_sparse_step == 0
        )

    def pooled_router_aux_loss_coef(self) -> float | None:
        """``router_aux_loss_coef`` with ``router_aux_loss_pooling="all_layers"``, else None."""
        return self.router_aux_loss_coef if self.router_aux_loss_pooling == "all_layers" else None
