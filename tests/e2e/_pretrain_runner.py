"""Run the main job (``examples/qwen3_moe/pretrain.py``) in-process: module-level, so the
distributed test harness can pickle it by reference and call it on every rank."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
EXAMPLE_DIR = REPO / "examples" / "qwen3_moe"
PRETRAIN = EXAMPLE_DIR / "pretrain.py"

# Small and fast: short rows, a small corpus slice, a log line per step, no progress bar.
FAST = [
    "--batching.seq_len=64",
    "--data.max_files=20",
    "--logging.progress_bar=false",
    "--logging.interval=1",
]


def _import_pretrain() -> Any:
    if str(EXAMPLE_DIR) not in sys.path:
        sys.path.insert(0, str(EXAMPLE_DIR))
    import pretrain

    return pretrain


def run(argv: list[str]) -> dict[str, float]:
    """``pretrain.main(argv)`` in this process (one rank under the harness)."""
    return _import_pretrain().main(list(argv))


def evaluate(argv: list[str]) -> dict[str, float]:
    """The main job's trainer built from ``argv`` on this rank, evaluated before any training step."""
    pretrain = _import_pretrain()
    config, args = pretrain.parse_args(list(argv))
    trainer = pretrain.build_trainer(config, config.data, pretrain.build_provider(config, args.init_from))
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
