"""The MoE layer: router + dispatcher + grouped experts (+ shared expert)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from plait.moe.capacity import DropPolicy, apply_capacity
from plait.moe.config import ClampedSwiGLU, RouterConfig, SwiGLU
from plait.moe.dispatch.base import TokenDispatcher
from plait.moe.dispatch.local import LocalDispatcher
from plait.moe.experts import GroupedExperts, SharedExpert
from plait.moe.router import TopKRouter
from torch import Tensor, nn


@dataclass(frozen=True)
class MoEOutput:
    """Result of a :class:`MoELayer` call.

    Attributes:
        hidden_states: ``[..., H]``, same shape and dtype as the input.
        aux_loss: fp32 scalar: the coefficient-weighted balancing losses (0 when none are enabled).
            Add it to the training loss.
        tokens_per_expert: ``[E]`` int64 assignments of real tokens routed in this call, before
            capacity dropping (detached, on device).
        losses: Unweighted detached loss components (``"switch"``, ``"seq"``, ``"z"``) for logging.
        switch_stats: The router's Switch-loss statistics (``RouterOutput.switch_stats``); with
            ``aux_loss_pooling="all_layers"`` the model pools them over its layers.
    """

    hidden_states: Tensor
    aux_loss: Tensor
    tokens_per_expert: Tensor
    losses: dict[str, Tensor] = field(default_factory=dict)
    switch_stats: Tensor | None = None


class MoELayer(nn.Module):
    """Mixture-of-Experts FFN block, numerically the Hugging Face Qwen3-MoE sparse block by default.

    With ``RouterConfig(score_func="softmax_over_topk", logit_bias=True)``,
    ``expert_activation=ClampedSwiGLU()`` and ``expert_proj_bias=True`` it is transformers' ``GptOssMLP``;
    with a sigmoid, group-limited router with a selection bias and a shared expert it is
    ``DeepseekV3MoE`` (see the package README).

    Args:
        hidden_size: H.
        moe_intermediate_size: I, each routed expert's FFN width.
        num_experts: E.
        router: Routing and balancing configuration.
        shared_expert_intermediate_size: Width of an always-on shared SwiGLU expert (``None`` = none).
        shared_expert_gate: Scale the shared expert's output by ``sigmoid(x @ w)``, ``w`` ``[1, H]``.
        capacity_factor: Per-expert slots as a multiple of ``T * k / E`` (local tokens); ``None``
            (default) is dropless.
        drop_policy: Which assignments an over-full expert keeps: ``"probs"`` (highest weight) or
            ``"position"`` (earliest tokens).
        expert_activation: The routed experts' activation: :class:`SwiGLU` (default) or
            :class:`ClampedSwiGLU`.
        expert_proj_bias: Give the routed experts' projections biases (``experts.gate_up_proj_bias``,
            ``experts.down_proj_bias``).

    Parameters: ``router.weight`` ``[E, H]`` (``router.bias`` ``[E]`` with ``logit_bias``),
    ``experts.gate_up_proj`` ``[E, 2I, H]`` (gate rows first), ``experts.down_proj`` ``[E, H, I]``
    (``experts.gate_up_proj_bias`` ``[E, 2I]``, ``experts.down_proj_bias`` ``[E, H]`` with
    ``expert_proj_bias``), ``shared_expert.{gate,up,down}_proj.weight``, ``shared_expert_gate.weight``
    ``[1, H]``; buffer ``router.expert_bias`` ``[E]`` with a selection bias.
    """

    def __init__(
        self,
        hidden_size: int,
        moe_intermediate_size: int,
        num_experts: int,
        router: RouterConfig,
        shared_expert_intermediate_size: int | None = None,
        shared_expert_gate: bool = False,
        capacity_factor: float | None = None,
        drop_policy: DropPolicy = "probs",
        expert_activation: SwiGLU | ClampedSwiGLU | None = None,
        expert_proj_bias: bool = False,
    ) -> None:
        super().__init__()
        if capacity_factor is not None and not capacity_factor > 0:
            raise ValueError(f"MoELayer.capacity_factor must be > 0 or None, got {capacity_factor}")
        if drop_policy not in ("probs", "position"):
            raise ValueError(f"MoELayer.drop_policy must be 'probs' or 'position', got {drop_policy!r}")
        if shared_expert_gate and shared_expert_intermediate_size is None:
            raise ValueError("MoELayer.shared_expert_gate needs shared_expert_intermediate_size")
        self.hidden_size = hidden_size
        self.num_experts = num_experts
        self.capacity_factor = capacity_factor
        self.drop_policy: DropPolicy = drop_policy
        self.router = TopKRouter(hidden_size, num_experts, router)
        self.experts = GroupedExperts(
            num_experts,
            hidden_size,
            moe_intermediate_size,
            activation=expert_activation,
            bias=expert_proj_bias,
        )
        self.shared_expert = (
            SharedExpert(hidden_size, shared_expert_intermediate_size)
            if shared_expert_intermediate_size is not None
            else None
        )
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False) if shared_expert_gate else None
        self.dispatcher: TokenDispatcher = LocalDispatcher()

    def forward(self, x: Tensor, token_mask: Tensor | None = None) -> MoEOutput:
        """Route, compute and combine.

        Args:
            x: ``[..., H]``. With 3+ dims the leading ones are sequences (``[B, S, H]``: B sequences
                for the sequence-level loss); a 2-D input is one sequence.
            token_mask: ``x.shape[:-1]`` bool (1 = real token, 0 = padding). Padding tokens go through
                the experts like any other but are left out of the balancing losses and statistics.
        """
        if x.shape[-1] != self.hidden_size:
            raise ValueError(f"MoELayer: input last dim {x.shape[-1]} != hidden_size {self.hidden_size}")
        shape = x.shape
        if token_mask is not None and tuple(token_mask.shape) != tuple(shape[:-1]):
            raise ValueError(
                f"MoELayer: token_mask shape {tuple(token_mask.shape)} != input shape {tuple(shape[:-1])}"
            )
        flat = x.reshape(-1, self.hidden_size)
        num_sequences = math.prod(shape[:-2]) if x.dim() >= 3 else 1
        mask = None if token_mask is None else token_mask.reshape(-1).to(torch.bool)
        routed = self.router(flat, num_sequences=num_sequences, token_mask=mask)
        topk_idx = routed.topk_idx
        if self.capacity_factor is not None:
            topk_idx = apply_capacity(
                topk_idx, routed.topk_weights, self.num_experts, self.capacity_factor, self.drop_policy
            )
        out = self.dispatcher(
            flat, topk_idx, routed.topk_weights, self.experts, has_dropped=self.capacity_factor is not None
        )
        if self.shared_expert is not None:
            shared = self.shared_expert(flat)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(flat)) * shared
            out = out + shared
        return MoEOutput(
            out.view(shape), routed.aux_loss, routed.tokens_per_expert, routed.losses, routed.switch_stats
        )

    def reset_parameters(self) -> None:
        """Re-initialise every weight, zero the expert bias and load counters (e.g. after ``to_empty``)."""
        self.router.reset_parameters()
        self.experts.reset_parameters()
        for module in (self.shared_expert, self.shared_expert_gate):
            if module is not None:
                for sub in module.modules():
                    if isinstance(sub, nn.Linear):
                        sub.reset_parameters()

    def tokens_per_expert_stats(self, reset: bool = True) -> Tensor:
        """Assignments per expert over training forwards since the last read (device tensor, no sync)."""
        return self.router.tokens_per_expert_stats(reset)

    def update_expert_bias(self, group: object = None) -> Tensor:
        """Auxiliary-loss-free balancing step; see :meth:`TopKRouter.update_expert_bias`."""
        return self.router.update_expert_bias(group)

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, num_experts={self.num_experts}, "
            f"capacity_factor={self.capacity_factor}, dispatcher={self.dispatcher!r}"
        )
