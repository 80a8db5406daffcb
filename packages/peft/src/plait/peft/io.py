"""Save and load only the trainable (adapter + full-tuned) parameters, as safetensors."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from plait.model_state import full_tensor
from plait.peft._dtensor import assign_full
from plait.peft.apply import trainable_parameters
from plait.peft.config import PeftConfig, PeftStackConfig
from pydantic import TypeAdapter
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

__all__ = ["load_adapter", "read_adapter_config", "save_adapter"]

_FORMAT = "plait-peft/1"
_CONFIG_ADAPTER: TypeAdapter[PeftStackConfig | PeftConfig] = TypeAdapter(PeftStackConfig | PeftConfig)  # type: ignore[arg-type]


def _is_writer() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def gather_full(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU copy of the whole tensor (all-gathers DTensors)."""
    return full_tensor(tensor.detach()).contiguous().cpu().clone()


def save_adapter(
    model: nn.Module,
    path: str | os.PathLike[str],
    config: PeftConfig | PeftStackConfig | None = None,
) -> list[str]:
    """Write the parameters with ``requires_grad`` to a safetensors file.

    On DTensor models this is a collective (call on every rank); only rank 0 writes.

    Args:
        model: a model passed through :func:`plait.peft.apply_peft`.
        path: output ``.safetensors`` file.
        config: the PEFT config, stored in the file metadata (read back by :func:`read_adapter_config`).

    Returns:
        The saved parameter names.
    """
    params = trainable_parameters(model)
    if not params:
        raise ValueError("save_adapter: the model has no trainable parameters (did you call apply_peft?)")
    tensors = {n: gather_full(p) for n, p in params.items()}
    if _is_writer():
        meta = {"format": _FORMAT}
        if config is not None:
            meta["config"] = config.model_dump_json()
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path), metadata=meta)
    return sorted(tensors)


def read_adapter_config(path: str | os.PathLike[str]) -> PeftConfig | PeftStackConfig | None:
    """The config stored by :func:`save_adapter`, or None if it was saved without one."""
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    raw = meta.get("config")
    return None if raw is None else _CONFIG_ADAPTER.validate_python(json.loads(raw))


@torch.no_grad()
def load_adapter(model: nn.Module, path: str | os.PathLike[str], strict: bool = True) -> list[str]:
    """Copy saved adapter tensors into ``model`` (already injected with the same config).

    Works on plain and DTensor parameters (each rank keeps its own shard). Dtypes are cast to the
    parameter's dtype.

    Args:
        model: the injected model.
        path: a file written by :func:`save_adapter`.
        strict: require the file's keys to equal the model's trainable parameter names.

    Returns:
        The loaded parameter names.
    """
    params = dict(model.named_parameters())
    trainable = set(trainable_parameters(model))
    with safe_open(str(path), framework="pt") as f:
        keys = list(f.keys())
        unknown = [k for k in keys if k not in params]
        if unknown:
            raise KeyError(f"load_adapter: {path}: keys not in the model: {unknown[:5]}")
        missing = sorted(trainable - set(keys))
        if strict and missing:
            raise KeyError(f"load_adapter: {path}: trainable parameters missing from the file: {missing[:5]}")
        for k in keys:
            copy_into(params[k], f.get_tensor(k), name=k)
    return keys


def copy_into(param: torch.Tensor, full: torch.Tensor, name: str) -> None:
    """Copy the whole tensor ``full`` into ``param`` (only this rank's shard for DTensors)."""
    if tuple(full.shape) != tuple(param.shape):
        raise ValueError(f"{name}: shape {tuple(full.shape)} in the file, {tuple(param.shape)} in the model")
    assign_full(param, full)
