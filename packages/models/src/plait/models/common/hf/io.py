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
from plait.dist_core import dtype_name
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
    """Load a Hugging Face checkpoint into plait stage module(s) in place through ``mapper`` (the family's
    Hugging Face -> plait mapper); returns the bytes read. See :func:`plait.models.load_hf_checkpoint`.

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
    """Export plait stage module(s) through ``mapper`` (plait -> Hugging Face) with ``hf_config`` as
    ``config.json`` (``dtype`` added when the tensors share one); collective. See
    :func:`plait.models.save_hf_checkpoint` for the arguments.
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
            hf["dtype"] = dtype_name(dtypes.pop())
        write_file_atomic(
            Path(out) / "config.json", (json.dumps(hf, indent=2, sort_keys=True) + "\n").encode()
        )
    if dist.is_available() and dist.is_initialized():
        dist.barrier(group)
    return Path(out)
