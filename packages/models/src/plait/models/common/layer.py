"""The pre-norm decoder layer every family builds from its own attention and MLP modules."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from plait.models.common.attention import AttentionMask
from plait.models.common.norm import RMSNorm
from plait.moe import MoELayer
from torch import nn

__all__ = ["AttentionModule", "DecoderLayer", "DenseMLP", "SequentialMixer"]


class AttentionModule(Protocol):
    """What a decoder layer needs of its attention (GQA, MLA, ...)."""

    sliding_window: int | None
    has_sinks: bool

    def __call__(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: AttentionMask
    ) -> torch.Tensor: ...

    def reset_parameters(self, std: float) -> None: ...


@runtime_checkable
class SequentialMixer(Protocol):
    """A token mixer that carries a state along the sequence (a linear-attention recurrence, e.g.
    :class:`plait.models.common.linear_attention.GatedDeltaNet`): context parallelism, which
    splits the sequence over ranks, cannot run it, and the parallel plan refuses it by name."""

    layer_type: str  # the Hugging Face ``layer_types`` name, e.g. ``"linear_attention"``


class DenseMLP(Protocol):
    """What a decoder layer needs of a dense feed-forward block."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    def reset_parameters(self, std: float) -> None: ...


class DecoderLayer(nn.Module):
    """Pre-norm decoder layer: ``h += attn(norm(h)); h += mlp(norm(h))``; the mlp is a dense block or
    a :class:`plait.moe.MoELayer`.

    Parameter names follow Hugging Face (``self_attn.q_proj``, ``mlp.gate_proj``, ...) except MoE
    blocks, which keep plait.moe's names (``mlp.router.weight``, ``mlp.experts.gate_up_proj``).

    Args:
        layer_idx: Global index of the layer.
        self_attn: The attention module (:class:`AttentionModule`).
        mlp: A dense MLP (:class:`DenseMLP`) or a :class:`plait.moe.MoELayer`.
        hidden_size: Model width (the norms).
        eps: RMSNorm epsilon.
        norm_offset: The norms' weight offset (``1.0``: zero-centred weights, see :class:`RMSNorm`).

    Attributes:
        last_aux_loss: Detached aux loss of the last forward (MoE layers; None otherwise).
        last_tokens_per_expert: Expert loads of the last forward (MoE layers; None otherwise).
    """

    def __init__(
        self,
        layer_idx: int,
        self_attn: nn.Module,
        mlp: nn.Module,
        hidden_size: int,
        eps: float,
        norm_offset: float = 0.0,
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.self_attn = self_attn
        self.mlp = mlp
        self.is_moe = isinstance(mlp, MoELayer)
        self.input_layernorm = RMSNorm(hidden_size, eps, norm_offset)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps, norm_offset)
        self.last_aux_loss: torch.Tensor | None = None
        self.last_tokens_per_expert: torch.Tensor | None = None

    @property
    def sliding_window(self) -> int | None:
        """The attention's window (which of a forward's masks this layer takes)."""
        attn: AttentionModule = self.self_attn  # type: ignore[assignment]
        return attn.sliding_window

    @property
    def has_sinks(self) -> bool:
        """Whether the attention has sink logits (its masks then need the log-sum-exp kernels)."""
        attn: AttentionModule = self.self_attn  # type: ignore[assignment]
        return attn.has_sinks

    def forward(
        self, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: AttentionMask
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """``hidden [B, S, H]`` -> ``(hidden [B, S, H], aux_loss, switch_stats)``: the MoE block's
        coefficient-weighted balancing loss and its Switch-loss statistics (to pool over layers);
        None for dense layers. Padding tokens (``mask.padding_mask``) are left out of both."""
        hidden, aux_loss, switch_stats, loads = self.block(hidden, rope, mask)
        if aux_loss is not None:
            self.last_aux_loss = aux_loss.detach()
            self.last_tokens_per_expert = loads
        return hidden, aux_loss, switch_stats

    def block(
        self, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: AttentionMask
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """The layer's computation, without side effects on the module (activation checkpointing
        wraps this: torch.compile cannot trace an attribute set inside a checkpointed region, and
        breaks the graph there): :meth:`forward`'s outputs and the MoE block's expert loads."""
        attn = self.self_attn(self.input_layernorm(hidden), rope, mask)
        x, hidden = self.post_attention_layernorm.forward_residual(attn, hidden)
        if not self.is_moe:
            return hidden + self.mlp(x), None, None, None
        out = self.mlp(x, mask.padding_mask)
        return hidden + out.hidden_states, out.aux_loss, out.switch_stats, out.tokens_per_expert

    def reset_parameters(self, std: float) -> None:
        """Hugging Face's init: normal(0, std) weights, zero biases and expert biases, unit norms; the
        routers' load counters (not in the state dict, uninitialised after ``to_empty``) start at 0."""
        attn: AttentionModule = self.self_attn  # type: ignore[assignment]
        attn.reset_parameters(std)
        if isinstance(self.mlp, MoELayer):
            for name, p in self.mlp.named_parameters():
                if name.endswith("bias"):
                    nn.init.zeros_(p)
                else:
                    nn.init.normal_(p, 0.0, std)
            with torch.no_grad():
                for b in self.mlp.buffers():  # the routers' expert bias and load counters
                    b.zero_()
        else:
            mlp: DenseMLP = self.mlp  # type: ignore[assignment]
            mlp.reset_parameters(std)
        self.input_layernorm.reset_parameters()
        self.post_attention_layernorm.reset_parameters()
