"""Pretrain a small Qwen3-MoE on an embedded corpus: the Python standard library's own source files.

    uv run examples/qwen3_moe/pretrain.py                         # CPU default (CUDA when present)
    uv run examples/qwen3_moe/pretrain.py --steps 50 --run-dir runs/x --optimizer.lr=1e-3
    uv run examples/qwen3_moe/pretrain.py --config examples/qwen3_moe/configs/gpu1.toml
    torchrun --nproc-per-node 2 examples/qwen3_moe/pretrain.py --mesh.data_shard=2 --mesh.expert=2

The family-neutral main job (``examples/train.py``) with this folder's configs, whose ``[model]``
sections are Qwen3-MoE's (``model_type`` defaults to ``qwen3_moe``). Byte-level tokens by default
(no tokenizer download; ``[data]`` takes other sources, formats and tokenizers: see ``train.py``), documents packed into fixed-length rows with per-document attention masking. The last
``data.validation_files`` files of the corpus are held out (never trained on) for the validation
loss (``[evaluation]``). The run writes ``<run_dir>/metrics.jsonl``, periodic async checkpoints
under ``<run_dir>/checkpoints`` (a rerun with the same run dir resumes), and at the end a Hugging
Face checkpoint in ``<run_dir>/hf`` that ``transformers.AutoModelForCausalLM.from_pretrained``
loads, a summary (printed and in ``<run_dir>/summary.json``) and ``<run_dir>/loss_curve.png``.

Bad flags, config files, paths or data stop it with one message and exit status 2 before anything is
built. Ctrl-C / SIGTERM finish the step, save a checkpoint and exit with 130 / 143, without the
Hugging Face export of the unfinished run unless ``--export-unfinished`` is given.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import ClassVar

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # examples/: the family-neutral job

import train
from train import (  # noqa: F401  (re-exported: scripts and tests build on this job)
    ConfigError,
    DataConfig,
    StartupError,
    build_and_resume,
    build_dataset,
    build_provider,
    build_trainer,
    check_corpus,
    check_paths,
    corpus_files,
)

HERE = Path(__file__).resolve().parent
DEFAULT_CONFIG = HERE / "configs" / "cpu.toml"


class PretrainConfig(train.TrainConfig):
    """The main job's config with Qwen3-MoE as the default family of ``[model]``."""

    DEFAULT_MODEL_TYPE: ClassVar[str | None] = "qwen3_moe"


def parse_args(argv: list[str]) -> tuple[train.TrainConfig, argparse.Namespace]:
    """Flags and dotted overrides -> the config and the flags (see :func:`train.parse_args`)."""
    return train.parse_args(argv, PretrainConfig, DEFAULT_CONFIG)


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Run the job (see :func:`train.main`)."""
    return train.main(argv, PretrainConfig, DEFAULT_CONFIG)


if __name__ == "__main__":
    main()
