"""Router and expert configuration."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class SwiGLU(BaseModel):
    """The experts' default activation: ``silu(gate) * up`` (Qwen3, DeepSeek-V3, Mixtral)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["swiglu"] = "swiglu"


class ClampedSwiGLU(BaseModel):
    """gpt-oss's clamped SwiGLU: ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)``, ``g = clamp(gate, max=limit)``.

    Attributes:
        alpha: Slope of the sigmoid gate (transformers' ``swiglu_alpha``).
        limit: Clamp bound (transformers' ``swiglu_limit``).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["clamped_swiglu"] = "clamped_swiglu"
    alpha: float = Field(default=1.702, gt=0.0)
    limit: float = Field(default=7.0, gt=0.0)


ExpertActivation = Annotated[SwiGLU | ClampedSwiGLU, Field(discriminator="kind")]
"""The routed experts' gated activation (a discriminated union on ``kind``)."""


class RouterConfig(BaseModel):
    """How tokens pick experts and how the choice is kept balanced.

    Attributes:
        score_func: ``"softmax"`` (Qwen/Mixtral: softmax over all experts, then top-k), ``"sigmoid"``
            (DeepSeek-V3) or ``"softmax_over_topk"`` (gpt-oss: top-k of the raw logits, then a softmax
            over the k selected logits); always computed in fp32.
        logit_bias: The router is a linear layer with a bias (``router.bias`` ``[E]``, gpt-oss).
        fp32_logits: Compute the logits in fp32 (``x.float() @ w.float().T``, DeepSeek-V3) instead of
            in the input dtype (Qwen3, gpt-oss). Same result in fp32.
        top_k: Experts per token.
        norm_topk_prob: Renormalise the k selected scores to sum to 1.
        scaling_factor: Multiplies the (renormalised) top-k weights (DeepSeek's ``routed_scaling_factor``).
        n_groups: Group-limited routing: number of expert groups (``None`` = off).
        topk_groups: Groups kept per token before the expert top-k.
        group_score: How a group is scored: its best expert (``"max"``, DeepSeek-V2) or the sum of its
            two best (``"top2_sum"``, DeepSeek-V3).
        aux_loss_coef: Switch-Transformer load-balancing loss coefficient (0 = off).
        aux_loss_pooling: Where the Switch loss is formed. ``"per_layer"``: the router adds
            ``aux_loss_coef`` times its own layer's loss to ``aux_loss`` (a model sums them over its
            layers, Megatron-style). ``"all_layers"``: the router leaves the Switch loss out of
            ``aux_loss`` and returns its statistics (``RouterOutput.switch_stats``); the model adds
            them up over all its MoE layers and takes one loss of the pooled statistics
            (:func:`plait.moe.switch_aux_loss_from_stats`), which is transformers'
            ``load_balancing_loss_func``.
        seq_aux_loss_coef: DeepSeek-V3 sequence-level balancing loss coefficient (0 = off).
        z_loss_coef: ST-MoE router z-loss coefficient (0 = off).
        selection_bias: The router holds a selection-only expert bias (``router.expert_bias``, fp32
            ``[E]``, a persistent buffer: transformers' ``e_score_correction_bias``). It is added to
            the scores to pick the experts and never enters the combine weights. Implied by
            ``bias_update_rate``; set it alone for a fixed (loaded, not updated) bias.
        bias_update_rate: Auxiliary-loss-free balancing: the bias moves by this rate after each
            optimizer step (:meth:`TopKRouter.update_expert_bias`); ``None`` = never updated (no
            bias at all unless ``selection_bias``).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    score_func: Literal["softmax", "sigmoid", "softmax_over_topk"] = "softmax"
    logit_bias: bool = False
    fp32_logits: bool = False
    top_k: int = Field(ge=1)
    norm_topk_prob: bool = False
    scaling_factor: float = Field(default=1.0, gt=0.0)
    n_groups: int | None = Field(default=None, ge=1)
    topk_groups: int | None = Field(default=None, ge=1)
    group_score: Literal["max", "top2_sum"] = "max"
    aux_loss_coef: float = Field(default=0.0, ge=0.0)
    aux_loss_pooling: Literal["per_layer", "all_layers"] = "per_layer"
    seq_aux_loss_coef: float = Field(default=0.0, ge=0.0)
    z_loss_coef: float = Field(default=0.0, ge=0.0)
    selection_bias: bool = False
    bias_update_rate: float | None = Field(default=None, gt=0.0)

    @property
    def has_selection_bias(self) -> bool:
        """Whether the router holds ``expert_bias`` (``selection_bias`` or a ``bias_update_rate``)."""
        return self.selection_bias or self.bias_update_rate is not None

    @model_validator(mode="after")
    def _check_groups(self) -> RouterConfig:
        if (self.n_groups is None) != (self.topk_groups is None):
            raise ValueError(
                "RouterConfig: set both n_groups and topk_groups for group-limited routing, or neither"
            )
        if self.n_groups is not None and self.topk_groups is not None and self.topk_groups > self.n_groups:
            raise ValueError(
                f"RouterConfig.topk_groups ({self.topk_groups}) must be <= n_groups ({self.n_groups})"
            )
        return self

    def validate_for(self, num_experts: int) -> None:
        """Check this config against a number of experts.

        Raises:
            ValueError: naming the offending field.
        """
        if self.top_k > num_experts:
            raise ValueError(f"RouterConfig.top_k ({self.top_k}) exceeds num_experts ({num_experts})")
        if self.n_groups is not None and self.topk_groups is not None:
            if num_experts % self.n_groups:
                raise ValueError(
                    f"RouterConfig.n_groups ({self.n_groups}) must divide num_experts ({num_experts})"
                )
            per_group = num_experts // self.n_groups
            if self.top_k > self.topk_groups * per_group:
                raise ValueError(
                    f"RouterConfig.top_k ({self.top_k}) exceeds the experts in topk_groups "
                    f"({self.topk_groups} groups x {per_group} experts)"
                )
            if self.group_score == "top2_sum" and per_group < 2:
                raise ValueError("RouterConfig.group_score='top2_sum' needs at least 2 experts per group")
