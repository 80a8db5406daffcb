"""Run the main job (``plait train``) in-process: module-level, so the distributed test harness can
pickle it by reference and call it on every rank."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from plait.loop.data import Corpus, DataConfig, MixtureDataset, PackedTokens
from plait.train import build_job, build_provider
from plait.train.train import main, parse_args

REPO = Path(__file__).resolve().parents[2]
# The command as a user runs it (a new process): ``python -m plait train``.
TRAIN_CMD = [sys.executable, "-m", "plait", "train"]

# Small and fast: short rows, a small corpus slice, a log line per step, no progress bar.
FAST = [
    "--batching.seq_len=64",
    "--data.max_files=20",
    "--logging.progress_bar=false",
    "--logging.interval=1",
]


def run(argv: list[str]) -> dict[str, float]:
    """``plait train ARGV`` in this process (one rank under the harness)."""
    return main(list(argv))


def dataset(data: DataConfig, seq_len: int, split: str = "train") -> PackedTokens | MixtureDataset:
    """The rows of ``split`` that the job reads for ``data``."""
    return Corpus(data, seq_len).split(split)  # type: ignore[arg-type]


def evaluate(argv: list[str]) -> dict[str, float]:
    """The main job's trainer built from ``argv`` on this rank, evaluated before any training step."""
    config, args = parse_args(list(argv))
    trainer = build_job(config, config.data, build_provider(config, args.init_from)).trainer(resume=False)
    try:
        return dict(trainer.evaluate())
    finally:
        trainer.close()


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The run's ``metrics.jsonl`` records that carry a training step and a loss, in file order."""
    path = Path(run_dir) / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in records if "step" in r and "loss" in r]


def losses(run_dir: str | Path) -> dict[int, float]:
    return {int(r["step"]): float(r["loss"]) for r in read_metrics(run_dir)}
