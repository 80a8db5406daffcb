"""Backpropagate an auxiliary loss through the activations instead of adding it to the loss.

Useful where the loss cannot see every layer's aux loss (pipeline stages that return only hidden
states): the layer's output carries the aux loss's gradient, Megatron's ``MoEAuxLossAutoScaler`` idea.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


class _AttachAuxLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden: Tensor, aux_loss: Tensor, scale: float) -> Tensor:
        ctx.save_for_backward(aux_loss)
        ctx.scale = scale
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None]:
        (aux_loss,) = ctx.saved_tensors
        return grad, torch.full_like(aux_loss, ctx.scale), None


def attach_aux_loss(hidden_states: Tensor, aux_loss: Tensor, scale: float = 1.0) -> Tensor:
    """Return ``hidden_states`` unchanged; its backward also sends ``d(aux_loss) = scale`` into the router.

    Gradients then equal those of ``loss + scale * aux_loss`` for any loss computed from the output.

    Args:
        hidden_states: The MoE layer's output.
        aux_loss: Its scalar aux loss (``MoEOutput.aux_loss``).
        scale: Multiplier for the aux loss gradient, e.g. ``1 / num_microbatches`` when the main
            loss is averaged over microbatches.
    """
    if not aux_loss.requires_grad:
        return hidden_states
    return _AttachAuxLoss.apply(hidden_states, aux_loss, scale)  # type: ignore[no-any-return]
