"""Model-level helpers for auxiliary-loss-free balancing and expert-load statistics."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from plait.moe.router import TopKRouter
from torch import Tensor, nn


def _routers(model: nn.Module) -> Iterator[tuple[str, TopKRouter]]:
    for name, module in model.named_modules():
        if isinstance(module, TopKRouter):
            yield name, module


def update_expert_biases(model: nn.Module, group: object = None) -> int:
    """Apply the bias update to every router of ``model`` that has ``bias_update_rate`` set.

    Args:
        model: Any module containing MoE layers.
        group: Data-parallel ``ProcessGroup`` / ``DeviceMesh`` the counts are summed over (``None``:
            local counts). Every rank in it must call this, for the same layers, in the same order.

    Returns:
        How many routers were updated.
    """
    n = 0
    for _, router in _routers(model):
        if router.config.bias_update_rate is not None:
            router.update_expert_bias(group)
            n += 1
    return n


def register_expert_bias_hook(
    optimizer: torch.optim.Optimizer, model: nn.Module, group: object = None
) -> Any:
    """Run :func:`update_expert_biases` after every ``optimizer.step()``.

    Returns:
        The hook handle (``.remove()`` to detach).
    """

    def hook(*_: Any, **__: Any) -> None:
        update_expert_biases(model, group)

    return optimizer.register_step_post_hook(hook)


def expert_load_stats(model: nn.Module, reset: bool = True) -> dict[str, Tensor]:
    """Per-router assignment counts since the last read, keyed by router module name (device tensors)."""
    return {name: router.tokens_per_expert_stats(reset) for name, router in _routers(model)}
