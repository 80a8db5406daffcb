"""``plait export RUN_DIR|CHECKPOINT --to DIR``: a Hugging Face checkpoint of any saved step, without
training.

    plait export runs/qwen3_moe --to runs/qwen3_moe/hf_step50      # the run's newest complete checkpoint
    plait export runs/qwen3_moe/checkpoints/step_00000050 --to DIR  # that step

The model is the one the checkpoint's run trained (its config is recorded in the checkpoint), built on
the CPU in one process; a checkpoint saved by any layout (FSDP, TP, EP, pipeline stages) loads into it.
The run's tokenizer, when it had one, is copied beside the weights. Runs of ``plait train``; adapters of
``plait finetune`` are exported by the run itself.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from plait.loop import ConfigError
from plait.loop.checkpoint import Checkpointer, ModelState, find_checkpoint
from plait.loop.data import Corpus
from plait.train.config import JobConfig, StartupError, describe_errors
from plait.train.job import build_provider, check_writable
from plait.train.train import complete_export, fail
from pydantic import ValidationError

__all__ = ["export_checkpoint_dir", "main"]


def export_checkpoint_dir(path: Path, out: Path) -> Path:
    """Write the model of checkpoint (or run directory) ``path`` as a Hugging Face checkpoint in ``out``.

    Raises:
        StartupError: no checkpoint, or one whose recorded config is not a ``plait train`` job's.
    """
    try:
        checkpoint, meta = find_checkpoint(path)
    except FileNotFoundError as e:
        raise StartupError(str(e)) from None
    try:
        config = JobConfig.model_validate(meta.get("config") or {})
    except ValidationError as e:
        raise StartupError(
            f"{checkpoint}: its recorded config is not a plait train job's: {describe_errors(e)}"
        ) from None
    if config.model is None:
        raise StartupError(f"{checkpoint}: its recorded config has no model")
    provider = build_provider(config)
    model = provider.build_stage(0, 1)
    provider.materialize(model, "cpu")
    Checkpointer(checkpoint.parent, async_mode="off").load(
        checkpoint, {"model": ModelState(model)}, strict=False
    )
    written = provider.export_hf([model], out)
    complete_export(written, Corpus(config.data, config.batching.seq_len))
    return written


def main(argv: list[str] | None = None, prog: str = "plait export") -> Path:
    """Run the command; returns the export directory (exit 2 with one message on bad input)."""
    ap = argparse.ArgumentParser(
        prog=prog,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    ap.add_argument("checkpoint", type=Path, metavar="RUN_DIR|CHECKPOINT")
    ap.add_argument(
        "--to", type=Path, required=True, metavar="DIR", help="where the Hugging Face checkpoint goes"
    )
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        check_writable("--to", args.to)
        out = export_checkpoint_dir(args.checkpoint, args.to)
    except (ConfigError, StartupError) as e:
        raise fail(prog, e) from None
    print(f"Hugging Face checkpoint: {out}")
    return out
