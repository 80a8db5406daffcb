"""DeepSeek-V3 configuration; fields mirror transformers' ``DeepseekV3Config``."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from plait.models.common.config import DecoderConfig, check_finite
from pydantic import Field, model_validator

__all__ = ["DeepseekV3Config"]


class DeepseekV3Config(DecoderConfig):
    """DeepSeek-V3 configuration (the shared fields: :class:`plait.models.DecoderConfig`).

    Attention is multi-head latent attention (MLA): queries through an optional low-rank
    bottleneck, keys and values expanded per head from one compressed latent, a decoupled rope key
    shared by all heads. Layers ``< first_k_dense_replace`` have a dense SwiGLU MLP, the others a
    MoE block (sigmoid scores, group-limited top-k with a selection-only correction bias, shared
    experts). ``head_dim`` is ``qk_rope_head_dim`` (as transformers sets it) and
    ``num_key_value_heads`` equals ``num_attention_heads`` (MLA has a key and a value per head).

    Attributes:
        q_lora_rank: Rank of the query bottleneck (``q_a_proj`` -> ``q_a_layernorm`` ->
            ``q_b_proj``); None: one ``q_proj``.
        kv_lora_rank: Rank of the compressed key/value latent (``kv_a_layernorm``'s width).
        qk_nope_head_dim: Per-head query/key width without RoPE.
        qk_rope_head_dim: Per-head query/key width with RoPE (the shared rope key's width).
        v_head_dim: Per-head value width.
        rope_interleave: RoPE on interleaved pairs ``(x0, x1), (x2, x3), ...`` (DeepSeek's layout)
            instead of the two halves.
        moe_intermediate_size: SwiGLU width of each routed expert.
        n_routed_experts: Routed experts per MoE layer.
        n_shared_experts: Shared experts (one SwiGLU of ``n_shared_experts * moe_intermediate_size``).
        num_experts_per_tok: Top-k.
        n_group: Expert groups for group-limited routing.
        topk_group: Groups kept per token (scored by the sum of their two best biased scores).
        norm_topk_prob: Renormalise the k selected scores to sum to 1.
        routed_scaling_factor: Multiplies the routed experts' combine weights.
        first_k_dense_replace: Number of leading dense-MLP layers.
        topk_method: Only ``noaux_tc`` (DeepSeek-V3's checkpoints).
        scoring_func: Only ``sigmoid``.
        num_nextn_predict_layers: Multi-token-prediction (MTP) modules of the checkpoint (weights
            ``model.layers.{num_hidden_layers + i}.*``). Built and trained only with
            ``mtp_loss_weight``; otherwise skipped on import with a logged note, not exported.
        mtp_loss_weight: plait-only: train ``num_nextn_predict_layers`` MTP modules with this weight
            (DeepSeek-V3's lambda: ``weight / D * sum_k`` of their mean cross-entropies, added to
            ``aux_loss``); None: MTP off. Needs the whole model on one stage (no pipeline split) and
            no context parallelism.
        bias_update_rate: plait-only: auxiliary-loss-free balancing rate (the loop calls
            ``update_expert_biases`` after each optimizer step); None: the correction bias stays as
            loaded.
        seq_aux_loss_coef: plait-only: DeepSeek-V3's sequence-wise balance loss coefficient (0 = off).
        fp8_block_size: plait-only, set on import from ``quantization_config.weight_block_size``:
            the checkpoint's weights are block-scaled FP8 and are dequantized while loading.
        output_router_logits: Accepted for compatibility (no effect).
    """

    model_type: Literal["deepseek_v3"] = "deepseek_v3"
    vocab_size: int = Field(default=129280, gt=0)
    hidden_size: int = Field(default=7168, gt=0)
    intermediate_size: int = Field(default=18432, gt=0)
    num_hidden_layers: int = Field(default=61, gt=0)
    num_attention_heads: int = Field(default=128, gt=0)
    max_position_embeddings: int = Field(default=4096, gt=0)
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 1
    q_lora_rank: int | None = Field(default=1536, gt=0)
    kv_lora_rank: int = Field(default=512, gt=0)
    qk_nope_head_dim: int = Field(default=128, gt=0)
    qk_rope_head_dim: int = Field(default=64, gt=0)
    v_head_dim: int = Field(default=128, gt=0)
    rope_interleave: bool = True
    moe_intermediate_size: int = Field(default=2048, gt=0)
    n_routed_experts: int = Field(default=256, gt=0)
    n_shared_experts: int = Field(default=1, ge=0)
    num_experts_per_tok: int = Field(default=8, gt=0)
    n_group: int = Field(default=8, gt=0)
    topk_group: int = Field(default=4, gt=0)
    norm_topk_prob: bool = True
    routed_scaling_factor: float = Field(default=2.5, gt=0.0)
    first_k_dense_replace: int = Field(default=3, ge=0)
    topk_method: str = "noaux_tc"
    scoring_func: str = "sigmoid"
    num_nextn_predict_layers: int = Field(default=1, ge=0)
    training_only_fields: ClassVar[frozenset[str]] = DecoderConfig.training_only_fields | {
        "mtp_loss_weight",
        "bias_update_rate",
        "seq_aux_loss_coef",
    }
    mtp_loss_weight: float | None = Field(default=None, gt=0.0)
    bias_update_rate: float | None = Field(default=None, gt=0.0)
    seq_aux_loss_coef: float = Field(default=0.0, ge=0.0)
    fp8_block_size: tuple[int, int] | None = None
    output_router_logits: bool = False

    @model_validator(mode="before")
    @classmethod
    def _derived_heads(cls, data: Any) -> Any:
        """``head_dim`` = ``qk_rope_head_dim`` and one key/value head per query head (as in
        transformers); odd rope widths are refused here, naming the key."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        rope = data.get("qk_rope_head_dim", 64)
        if isinstance(rope, int) and rope % 2:
            interleave = data.get("rope_interleave", True)
            raise ValueError(
                f"qk_rope_head_dim={rope} must be even (RoPE rotates pairs; rope_interleave={interleave})"
            )
        if data.get("head_dim") not in (None, rope):
            raise ValueError(f"head_dim={data['head_dim']} must equal qk_rope_head_dim={rope} (or be unset)")
        data["head_dim"] = rope
        heads = data.get("num_attention_heads", 128)
        if data.get("num_key_value_heads") not in (None, heads):
            raise ValueError(
                f"num_key_value_heads={data['num_key_value_heads']}: multi-head latent attention has one "
                f"key/value per query head (num_attention_heads={heads}); leave it unset"
            )
        data["num_key_value_heads"] = heads
        return data

    @model_validator(mode="after")
    def _check_deepseek(self) -> DeepseekV3Config:
        check_finite(self)
        if self.topk_method != "noaux_tc":
            raise ValueError(f"topk_method={self.topk_method!r} is not supported (only 'noaux_tc')")
        if self.scoring_func != "sigmoid":
            raise ValueError(f"scoring_func={self.scoring_func!r} is not supported (only 'sigmoid')")
        if self.n_routed_experts % self.n_group:
            raise ValueError(
                f"n_routed_experts ({self.n_routed_experts}) must be divisible by n_group ({self.n_group})"
            )
        if self.topk_group > self.n_group:
            raise ValueError(f"topk_group ({self.topk_group}) must be <= n_group ({self.n_group})")
        per_group = self.n_routed_experts // self.n_group
        if per_group < 2:
            raise ValueError(
                f"n_routed_experts // n_group = {per_group}: each group needs >= 2 experts "
                "(a group's score is the sum of its two best)"
            )
        if self.num_experts_per_tok > self.topk_group * per_group:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) > the experts of topk_group "
                f"({self.topk_group}) groups of {per_group}"
            )
        if self.first_k_dense_replace > self.num_hidden_layers:
            raise ValueError(
                f"first_k_dense_replace ({self.first_k_dense_replace}) > num_hidden_layers "
                f"({self.num_hidden_layers})"
            )
        if self.mtp_loss_weight is not None and self.num_nextn_predict_layers < 1:
            raise ValueError(
                f"mtp_loss_weight={self.mtp_loss_weight} needs num_nextn_predict_layers >= 1 (got "
                f"{self.num_nextn_predict_layers})"
            )
        if self.fp8_block_size is not None and min(self.fp8_block_size) <= 0:
            raise ValueError(f"fp8_block_size={self.fp8_block_size} must be positive")
        return self

    @property
    def rope_head_dim(self) -> int:
        """RoPE rotates the ``qk_rope_head_dim`` part of each head (and the shared rope key)."""
        return self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        """Per-head query/key width (``qk_nope_head_dim + qk_rope_head_dim``)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def num_experts(self) -> int:
        """Routed experts per MoE layer (``n_routed_experts``)."""
        return self.n_routed_experts

    @property
    def mtp_layer_ids(self) -> list[int]:
        """Global indices of the MTP modules plait builds (after the decoder layers; none when off)."""
        if self.mtp_loss_weight is None:
            return []
        return list(range(self.num_hidden_layers, self.num_hidden_layers + self.num_nextn_predict_layers))

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Layers from ``first_k_dense_replace`` on are MoE layers."""
        return layer_idx >= self.first_k_dense_replace
