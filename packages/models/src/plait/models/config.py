"""Model configurations mirroring transformers' ``Qwen3Config`` and ``Qwen3MoeConfig``.

Field names follow the Hugging Face configs so a ``config.json`` maps onto them key for key
(see :mod:`plait.models.hf.config` for the conversion). Fields that only plait uses
(``attn_implementation``, ``router_aux_loss_pooling``) are never written to ``config.json``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["AttentionImplementation", "Qwen3Config", "Qwen3MoeConfig", "RopeParameters"]

AttentionImplementation = Literal["auto", "sdpa", "flex", "flash"]


class RopeParameters(BaseModel):
    """Rotary position embedding parameters (transformers 5.x ``rope_parameters``).

    Attributes:
        rope_type: ``default``, ``linear`` (position interpolation), ``dynamic`` (dynamic NTK) or
            ``yarn``.
        rope_theta: Base wavelength.
        factor: Context-extension factor (``linear``, ``dynamic``, ``yarn``).
        original_max_position_embeddings: Pre-training context length (``yarn``).
        attention_factor: YaRN cos/sin scale; inferred from ``factor`` (and ``mscale``) if None.
        beta_fast: YaRN extrapolation boundary (default 32).
        beta_slow: YaRN interpolation boundary (default 1).
        mscale: YaRN ``mscale`` (DeepSeek style attention factor).
        mscale_all_dim: YaRN ``mscale_all_dim``.
        truncate: YaRN: round the correction range to whole dimensions.
        partial_rotary_factor: Fraction of each head's dimensions that are rotated.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    rope_type: Literal["default", "linear", "dynamic", "yarn"] = "default"
    rope_theta: float = 10000.0
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    attention_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    partial_rotary_factor: float = Field(default=1.0, gt=0.0, le=1.0)

    @model_validator(mode="after")
    def _check(self) -> RopeParameters:
        if self.rope_type in ("linear", "dynamic") and self.factor is None:
            raise ValueError(f"rope_parameters.factor is required for rope_type={self.rope_type!r}")
        if self.rope_type == "yarn" and self.original_max_position_embeddings is None:
            raise ValueError(
                "rope_parameters.original_max_position_embeddings is required for rope_type='yarn'"
            )
        return self


class Qwen3Config(BaseModel):
    """Qwen3 (dense) configuration; fields mirror ``transformers.Qwen3Config``.

    Attributes:
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
        use_sliding_window: Must be False (sliding-window attention is not implemented).
        pad_token_id: Padding token (embedding ``padding_idx``; last-token pooling).
        bos_token_id: Beginning-of-sequence token (metadata only).
        eos_token_id: End-of-sequence token(s) (metadata only).
        attn_implementation: plait-only: attention backend (``auto`` picks FlashAttention when it
            is installed and the inputs are on CUDA in half precision, else SDPA, FlexAttention for
            packed documents on CUDA).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    model_type: Literal["qwen3", "qwen3_moe"] = "qwen3"
    vocab_size: int = Field(default=151936, gt=0)
    hidden_size: int = Field(default=4096, gt=0)
    intermediate_size: int = Field(default=22016, gt=0)
    num_hidden_layers: int = Field(default=32, gt=0)
    num_attention_heads: int = Field(default=32, gt=0)
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: Literal["silu"] = "silu"
    max_position_embeddings: int = 32768
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    rope_parameters: RopeParameters = RopeParameters()
    attention_bias: bool = False
    attention_dropout: float = 0.0
    use_sliding_window: bool = False
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    attn_implementation: AttentionImplementation = "auto"

    @model_validator(mode="after")
    def _check(self) -> Qwen3Config:
        if self.num_attention_heads % self.kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.kv_heads})"
            )
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ValueError("head_dim is None and hidden_size is not divisible by num_attention_heads")
        if self.attention_dropout != 0.0:
            raise ValueError("attention_dropout must be 0.0: plait does not implement attention dropout")
        if self.use_sliding_window:
            raise ValueError("use_sliding_window=True is not supported by plait's Qwen3")
        rot = self.resolved_head_dim * self.rope_parameters.partial_rotary_factor
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

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether decoder layer ``layer_idx`` uses a sparse MoE block (always False for dense)."""
        del layer_idx
        return False


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
