"""Load Hugging Face checkpoints into plait stage modules (sharded or not) and export them back,
given the family's mapper and ``config.json`` (the entry points in :mod:`plait.models.hf` pick them)."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from plait.model_state import Mapper, load_module, materialize, save_module, write_file_atomic
from torch import nn

__all__ = ["load_checkpoint", "save_checkpoint"]


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


def _zero_transient_buffers(module: nn.Module) -> None:
    """Zero the buffers a checkpoint does not hold (running statistics such as the MoE routers'
    load counters), which ``to_empty`` left uninitialised."""
    with torch.no_grad():
        for m in module.modules():
            for name in m._non_persistent_buffers_set:
                buf = m._buffers.get(name)
                if buf is not None:
                    buf.zero_()


def load_checkpoint(
    modules: nn.Module | Sequence[nn.Module],
    path: str | os.PathLike[str],
    mapper: Mapper,
    *,
    allow_cast: bool = True,
    device: torch.device | str | None = None,
) -> int:
    """Load a Hugging Face checkpoint directory into plait stage module(s), in place.

    Works on plain, meta-device, FSDP2, tensor-parallel, expert-parallel and pipeline-stage modules:
    every rank reads only the bytes of the shards it holds (``plait.model_state.load_module`` with
    the family's ``mapper``). Checkpoint keys of other stages are skipped unread.

    Args:
        modules: One stage module or all stages this rank holds.
        path: Checkpoint directory (``model.safetensors`` or sharded with an index).
        mapper: The family's Hugging Face -> plait mapper.
        allow_cast: Cast checkpoint dtypes to the module's parameter dtypes (e.g. bf16 -> fp32).
        device: Where to materialise meta modules.

    Returns:
        Bytes read by this process.

    Raises:
        KeyError: the checkpoint lacks parameters the module(s) need (listed).
    """
    for stage in [modules] if isinstance(modules, nn.Module) else modules:
        if materialize(stage, device):  # each stage on its own: its tied names are its own keys
            _zero_transient_buffers(stage)
    module = _as_module(modules)
    result = load_module(
        module,
        path,
        mapper,
        strict=False,
        allow_cast=allow_cast,
        device=device,
    )
    if result.missing:
        raise KeyError(
            f"checkpoint {os.fspath(path)!r} lacks {len(result.missing)} key(s): {list(result.missing)[:20]}"
        )
    return result.bytes_read


def save_checkpoint(
    modules: nn.Module | Sequence[nn.Module],
    out_dir: str | os.PathLike[str],
    mapper: Mapper,
    hf_config: dict[str, Any],
    *,
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
        mapper: The family's plait -> Hugging Face mapper.
        hf_config: The ``config.json`` dict (``dtype`` is added when the tensors share one).
        is_writer: Whether this rank writes its keys.
        group: Process group of the save (default: world).
        max_shard_size: Per-file size bound.

    Returns:
        The checkpoint directory.
    """
    module = _as_module(modules)
    out = save_module(
        module,
        out_dir,
        mapper,
        is_writer=is_writer,
        group=group,
        max_shard_size=max_shard_size,
    )
    rank = dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0
    if rank == 0:
        hf = dict(hf_config)
        dtypes = {v.dtype for v in module.state_dict().values() if v.is_floating_point()}
        if len(dtypes) == 1:
            hf["dtype"] = str(dtypes.pop()).removeprefix("torch.")
        write_file_atomic(
            Path(out) / "config.json", (json.dumps(hf, indent=2, sort_keys=True) + "\n").encode()
        )
    if dist.is_available() and dist.is_initialized():
        dist.barrier(group)
    return Path(out)
