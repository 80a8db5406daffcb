"""Optimizer construction: AdamW (fused where available), plait.kernels' StochasticAdamW, SGD.

Parameters of norms, biases and embeddings get no weight decay (the usual LLM recipe).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from plait.dist_core import parse_dtype
from plait.loop.config.sections import AdamWConfig, OptimizerConfig, SGDConfig, StochasticAdamWConfig
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["build_optimizer", "param_groups", "wants_no_decay"]

_NORM_TYPES: tuple[type[nn.Module], ...] = (
    nn.LayerNorm,
    nn.GroupNorm,
    nn.BatchNorm1d,
    nn.BatchNorm2d,
    nn.RMSNorm,
)


def wants_no_decay(module: nn.Module, param_name: str, param: torch.Tensor) -> bool:
    """Whether a parameter belongs to a norm, is a bias or an embedding (no weight decay).

    Norm layers are recognised by type or by a class/parameter name containing ``norm``; embeddings
    by ``nn.Embedding`` or a name containing ``embed``; biases and other 1-d tensors by shape.
    """
    if param.ndim <= 1 or param_name.endswith("bias"):
        return True
    if isinstance(module, (*_NORM_TYPES, nn.Embedding)):
        return True
    cls = type(module).__name__.lower()
    return "norm" in cls or "embed" in cls or "embed" in param_name.lower()


def param_groups(
    modules: nn.Module | Sequence[nn.Module], weight_decay: float, split: bool = True
) -> list[dict[str, Any]]:
    """Trainable parameters as ``[decay_group, no_decay_group]`` (empty groups dropped).

    Args:
        modules: the model (or its local pipeline stages).
        weight_decay: the decay of the first group.
        split: False puts every parameter in one decayed group.
    """
    mods = [modules] if isinstance(modules, nn.Module) else list(modules)
    decay: list[torch.Tensor] = []
    no_decay: list[torch.Tensor] = []
    seen: set[int] = set()
    for root in mods:
        for mod_name, module in root.named_modules():
            for p_name, p in module.named_parameters(recurse=False):
                if not p.requires_grad or id(p) in seen:
                    continue
                seen.add(id(p))
                full = f"{mod_name}.{p_name}" if mod_name else p_name
                (no_decay if split and wants_no_decay(module, full, p) else decay).append(p)
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def _fused_ok(params: Iterable[torch.Tensor]) -> bool:
    # torch's fused AdamW needs floating tensors on a CUDA (or other accelerator) device.
    return all(p.device.type not in ("cpu", "meta") and p.is_floating_point() for p in params)


def split_by_tensor_kind(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each group split in two where it mixes DTensor and plain-tensor parameters (same settings).

    torch's fused AdamW updates a group in one multi-tensor call, which DTensor's dispatch refuses when
    some of its tensors are DTensors and some are not (tensor parallelism without FSDP leaves the
    norms plain). Optimizer checkpoints name parameters by FQN, so resuming across layouts whose
    groups split differently stays possible.
    """
    out = []
    for group in groups:
        for is_dtensor in (True, False):
            params = [p for p in group["params"] if isinstance(p, DTensor) == is_dtensor]
            if params:
                out.append({**group, "params": params})
    return out


def build_optimizer(
    config: OptimizerConfig, modules: nn.Module | Sequence[nn.Module]
) -> torch.optim.Optimizer:
    """The optimizer described by ``config`` over ``modules``' trainable parameters.

    Raises:
        ValueError: when no parameter requires a gradient.
    """
    groups = param_groups(modules, config.weight_decay, config.no_decay_norms_biases_embeddings)
    if not groups:
        raise ValueError("build_optimizer: the model has no parameter with requires_grad=True")
    if isinstance(config, AdamWConfig):
        flat = [p for g in groups for p in g["params"]]
        fused = _fused_ok(flat) if config.fused is None else config.fused
        return torch.optim.AdamW(
            split_by_tensor_kind(groups) if fused else groups,
            lr=config.lr,
            betas=config.betas,
            eps=config.eps,
            weight_decay=config.weight_decay,
            fused=fused,
        )
    if isinstance(config, StochasticAdamWConfig):
        from plait.kernels import StochasticAdamW

        return StochasticAdamW(  # type: ignore[no-any-return]
            groups,
            lr=config.lr,
            betas=config.betas,
            eps=config.eps,
            weight_decay=config.weight_decay,
            moment_dtype=parse_dtype(config.moment_dtype),
            seed=config.seed,
        )
    if isinstance(config, SGDConfig):
        return torch.optim.SGD(
            groups,
            lr=config.lr,
            momentum=config.momentum,
            nesterov=config.nesterov,
            weight_decay=config.weight_decay,
        )
    raise TypeError(f"optimizer: unknown config {type(config).__name__}")  # pragma: no cover
