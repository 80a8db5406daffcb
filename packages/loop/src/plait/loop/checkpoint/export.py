"""Model-only export of a training checkpoint to Hugging Face safetensors through a mapper."""

from __future__ import annotations

import json
from pathlib import Path

from plait.loop.checkpoint import _layout
from plait.loop.checkpoint.checkpointer import Checkpointer
from plait.loop.checkpoint.state import ModelState
from plait.model_state import Mapper, save_module
from torch import nn


def find_checkpoint(path: str | Path) -> tuple[Path, dict]:
    """The checkpoint that ``path`` names and its marker's metadata (``step``, ``config``, ...): ``path``
    itself when it is a complete checkpoint, else the newest intact one under ``path/checkpoints`` (a run
    directory) or under ``path`` (a checkpoints directory). One process; nothing is deleted.

    Raises:
        FileNotFoundError: no complete, intact checkpoint there.
    """
    path = Path(path)
    found: Path | None = path if (path / _layout.MARKER).is_file() else None
    for root in (path / "checkpoints", path):
        if found is None and root.is_dir():
            found = Checkpointer(root, async_mode="off").latest(clean=False)
    if found is None:
        raise FileNotFoundError(
            f"{path}: no complete checkpoint here (give a run directory, its checkpoints or one of them)"
        )
    return found, json.loads((found / _layout.MARKER).read_text())


def export_checkpoint(
    checkpoint: str | Path,
    model: nn.Module,
    out_dir: str | Path,
    mapper: Mapper | None = None,
    *,
    max_shard_size: int | str = "5GB",
) -> Path:
    """Load the model part of a DCP training checkpoint into ``model`` and write it as safetensors.

    Runs in one process: ``model`` is a plain (unsharded) module with the training model's FQNs;
    a checkpoint saved by any layout (FSDP, EP, PP stages) loads into it, since DCP stores global
    tensors. ``mapper`` maps module keys to the target format's keys (e.g. a model's plait -> HF
    mapper); ``None`` keeps the module's names.
    """
    checkpoint = Path(checkpoint)
    Checkpointer(checkpoint.parent, async_mode="off").load(
        checkpoint, {"model": ModelState(model)}, strict=False
    )
    return save_module(model, out_dir, mapper, max_shard_size=max_shard_size, distributed=False)
