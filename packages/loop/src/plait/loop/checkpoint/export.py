"""Model-only export of a training checkpoint to Hugging Face safetensors through a mapper."""

from __future__ import annotations

from pathlib import Path

from plait.loop.checkpoint.checkpointer import Checkpointer
from plait.loop.checkpoint.state import ModelState
from plait.model_state import Mapper, save_module
from torch import nn


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
