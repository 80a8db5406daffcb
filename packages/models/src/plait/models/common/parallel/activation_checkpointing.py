"""Activation checkpointing of decoder layers (full, every k-th, selective by op type)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from plait.models.common.layer import DecoderLayer
from plait.models.common.parallel.config import ActivationCheckpointing
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

__all__ = ["apply_activation_checkpointing"]


def _policy(save_ops: frozenset[str]) -> Callable[..., CheckpointPolicy]:
    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if str(op) in save_ops else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _wrap(layer: DecoderLayer, context_fn: Callable[[], Any] | None) -> None:
    # The layer's block, not its forward: the forward records the MoE statistics on the module, a
    # side effect torch.compile does not trace inside a checkpointed region (it would break the graph
    # and run the layer eagerly).
    inner = layer.block

    @functools.wraps(inner)
    def forward(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return inner(*args, **kwargs)
        extra: dict[str, Any] = {} if context_fn is None else {"context_fn": context_fn}
        return checkpoint(inner, *args, use_reentrant=False, **extra, **kwargs)

    # Instance attribute: parameter names (and so checkpoints and mappers) stay unchanged.
    layer.block = forward  # type: ignore[method-assign]


def apply_activation_checkpointing(
    layers: dict[int, DecoderLayer], config: ActivationCheckpointing
) -> list[int]:
    """Checkpoint the selected layers in place; returns the global indices that were wrapped.

    Args:
        layers: Decoder layers by global index.
        config: Policy.
    """
    if config.mode == "none":
        return []
    context_fn = None
    if config.mode == "selective":
        policy = _policy(frozenset(config.save_ops))
        context_fn = functools.partial(create_selective_checkpoint_contexts, policy)
    done = []
    for idx, layer in sorted(layers.items()):
        if idx % config.every == 0:
            _wrap(layer, context_fn)
            done.append(idx)
    return done
