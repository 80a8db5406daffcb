"""Load Hugging Face Qwen3 / Qwen3-MoE checkpoints into plait modules (sharded or not) and export back."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from plait.model_state import load_module, materialize, save_module, write_file_atomic
from plait.models.config import Qwen3Config
from plait.models.hf.config import config_to_hf, load_hf_config
from plait.models.hf.mappers import hf_to_plait_mapper, plait_to_hf_mapper
from torch import nn

__all__ = ["from_pretrained", "load_hf_checkpoint", "save_hf_checkpoint"]


class _Stages(nn.Module):
    """Presents several local pipeline stages as one state dict (their keys are disjoint)."""

    def __init__(self, stages: Sequence[nn.Module]) -> None:
        super().__init__()
        self._stages = list(stages)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        out: dict[str, Any] = {}
        for s in self._stages:
            out.update(s.state_dict(*args, **kwargs))
        return out


def _as_module(modules: nn.Module | Sequence[nn.Module]) -> nn.Module:
    if isinstance(modules, nn.Module):
        return modules
    return modules[0] if len(modules) == 1 else _Stages(modules)


def _config_of(modules: nn.Module | Sequence[nn.Module]) -> Qwen3Config:
    first = modules if isinstance(modules, nn.Module) else modules[0]
    config = getattr(first, "config", None)
    if not isinstance(config, Qwen3Config):
        raise TypeError(f"{type(first).__name__} has no plait Qwen3Config at .config")
    return config


def load_hf_checkpoint(
    modules: nn.Module | Sequence[nn.Module],
    path: str | os.PathLike[str],
    *,
    allow_cast: bool = True,
    device: torch.device | str | None = None,
) -> int:
    """Load a Hugging Face checkpoint directory into plait stage module(s), in place.

    Works on plain, meta-device, FSDP2, tensor-parallel, expert-parallel and pipeline-stage modules:
    every rank reads only the bytes of the shards it holds (``plait.model_state.load_module`` with
    :func:`hf_to_plait_mapper`). Checkpoint keys of other stages are skipped unread.

    Args:
        modules: One stage module or all stages this rank holds.
        path: Checkpoint directory (``model.safetensors`` or sharded with an index).
        allow_cast: Cast checkpoint dtypes to the module's parameter dtypes (e.g. bf16 -> fp32).
        device: Where to materialise meta modules.

    Returns:
        Bytes read by this process.

    Raises:
        KeyError: the checkpoint lacks parameters the module(s) need (listed).
    """
    for stage in [modules] if isinstance(modules, nn.Module) else modules:
        materialize(stage, device)  # each stage on its own: its tied names are its own keys
    module = _as_module(modules)
    result = load_module(
        module,
        path,
        hf_to_plait_mapper(_config_of(modules)),
        strict=False,
        allow_cast=allow_cast,
        device=device,
    )
    if result.missing:
        raise KeyError(
            f"checkpoint {os.fspath(path)!r} lacks {len(result.missing)} key(s): {list(result.missing)[:20]}"
        )
    return result.bytes_read


def save_hf_checkpoint(
    modules: nn.Module | Sequence[nn.Module],
    out_dir: str | os.PathLike[str],
    *,
    fused_experts: bool = False,
    is_writer: bool | None = None,
    group: dist.ProcessGroup | None = None,
    max_shard_size: int | str = "5GB",
) -> Path:
    """Export plait stage module(s) as a Hugging Face checkpoint (safetensors + ``config.json``).

    Collective when torch.distributed is initialised: every rank calls it with its local stages
    (DTensors are gathered group by group). ``is_writer`` marks the ranks that write their stages'
    keys: by default the first rank of ``group``; with pipeline parallelism pass True on one rank
    per stage (e.g. the data-parallel rank 0 of each stage). ``config.json`` is written by the
    first rank of ``group``.

    Args:
        modules: Stage module(s) on this rank.
        out_dir: Output directory (its shards, index and ``config.json`` are replaced; other files stay).
        fused_experts: Write transformers 5.x fused expert tensors instead of per-expert keys.
        is_writer: Whether this rank writes its keys.
        group: Process group of the save (default: world).
        max_shard_size: Per-file size bound.

    Returns:
        The checkpoint directory.
    """
    config = _config_of(modules)
    module = _as_module(modules)
    out = save_module(
        module,
        out_dir,
        plait_to_hf_mapper(config, fused_experts=fused_experts),
        is_writer=is_writer,
        group=group,
        max_shard_size=max_shard_size,
    )
    rank = dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0
    if rank == 0:
        hf = config_to_hf(config)
        dtypes = {v.dtype for v in module.state_dict().values() if v.is_floating_point()}
        if len(dtypes) == 1:
            hf["dtype"] = str(dtypes.pop()).removeprefix("torch.")
        write_file_atomic(
            Path(out) / "config.json", (json.dumps(hf, indent=2, sort_keys=True) + "\n").encode()
        )
    if dist.is_available() and dist.is_initialized():
        dist.barrier(group)
    return Path(out)


def from_pretrained(
    path: str | os.PathLike[str],
    *,
    stage_index: int = 0,
    num_stages: int = 1,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    **config_overrides: Any,
) -> nn.Module:
    """Build a :class:`~plait.models.Qwen3ForCausalLM` (stage) from a Hugging Face checkpoint directory.

    For sharded models build on meta, :func:`plait.models.parallelize`, then
    :func:`load_hf_checkpoint` instead.

    Args:
        path: Checkpoint directory with ``config.json``.
        stage_index: Pipeline stage to build.
        num_stages: Number of pipeline stages.
        device: Target device.
        dtype: Parameter dtype (default: fp32).
        **config_overrides: plait config fields to override (e.g. ``attn_implementation``).
    """
    from plait.models.qwen3.model import Qwen3ForCausalLM

    config = load_hf_config(path)
    if config_overrides:
        config = type(config)(**{**config.model_dump(), **config_overrides})
    with torch.device("meta"):
        model = Qwen3ForCausalLM(config, stage_index=stage_index, num_stages=num_stages)
    if dtype is not None:
        model.to(dtype)
    load_hf_checkpoint(model, path, device=device)
    return model
