"""Pretrain a small Qwen3-MoE on an embedded corpus: the Python standard library's own source files.

    uv run examples/qwen3_moe/pretrain.py                         # CPU default (CUDA when present)
    uv run examples/qwen3_moe/pretrain.py --steps 50 --run-dir runs/x --optimizer.lr=1e-3
    uv run examples/qwen3_moe/pretrain.py --config examples/qwen3_moe/configs/gpu1.toml
    torchrun --nproc-per-node 2 examples/qwen3_moe/pretrain.py --config examples/qwen3_moe/configs/cpu_fsdp2.toml

Byte-level tokens (no tokenizer download), documents packed into fixed-length rows with per-document
attention masking. The last ``data.validation_files`` files of the corpus are held out (never trained
on) for the validation loss (``[evaluation]``). The run writes ``<run_dir>/metrics.jsonl``, periodic async checkpoints under
``<run_dir>/checkpoints`` (a rerun with the same run dir resumes), and at the end a Hugging Face
checkpoint in ``<run_dir>/hf`` that ``transformers.AutoModelForCausalLM.from_pretrained`` loads.
"""

from __future__ import annotations

import argparse
import sys
import sysconfig
from pathlib import Path
from typing import Literal

import torch
from plait.loop import CausalLMTask, DatasetProvider, ModelProvider, Trainer, TrainerConfig, load_config
from plait.loop.data import ByteTokenizer, PackedTokens, pack_documents
from plait.models import ParallelConfig, Qwen3MoeConfig, Qwen3Provider
from pydantic import BaseModel, ConfigDict, Field

HERE = Path(__file__).resolve().parent
DEFAULT_CONFIG = HERE / "configs" / "cpu.toml"


class DataConfig(BaseModel):
    """Where the text comes from and how it is cut."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    source: str = Field(
        "stdlib", description="'stdlib' (this Python's own library sources) or a directory of text files"
    )
    pattern: str = "*.py"
    max_files: int | None = Field(
        400, ge=1, description="Cap on training files (sorted by path), None for all"
    )
    validation_files: int = Field(
        8, ge=1, description="The corpus's last files (sorted by path), held out for evaluation"
    )


class PretrainConfig(TrainerConfig):
    """The loop's config plus the model, its parallel plan and the data."""

    model: Qwen3MoeConfig
    # bfloat16 parameters pair with optimizer.name = "stochastic_adamw" (stochastic rounding).
    model_dtype: Literal["float32", "bfloat16"] = "float32"
    parallel: ParallelConfig = ParallelConfig()
    data: DataConfig = DataConfig()


def corpus_files(cfg: DataConfig, split: Literal["train", "validation"] = "train") -> list[Path]:
    """The training files (the first ``max_files``) or the held-out validation files (the last ones)."""
    root = Path(sysconfig.get_paths()["stdlib"]) if cfg.source == "stdlib" else Path(cfg.source)
    if not root.is_dir():
        raise FileNotFoundError(f"data.source: {root} is not a directory")
    files = sorted(p for p in root.rglob(cfg.pattern) if p.is_file() and "site-packages" not in p.parts)
    if len(files) <= cfg.validation_files:
        raise FileNotFoundError(
            f"data.source: {len(files)} files matching {cfg.pattern!r} under {root}, not more than "
            f"data.validation_files={cfg.validation_files}"
        )
    n = len(files) - cfg.validation_files
    return files[:n][: cfg.max_files] if split == "train" else files[n:]


def build_dataset(
    cfg: DataConfig, seq_len: int, split: Literal["train", "validation"] = "train"
) -> PackedTokens:
    """Byte-tokenised files, each followed by an end-of-document token, packed into rows of ``seq_len``."""
    tok = ByteTokenizer()
    docs = (tok.encode(p.read_text(encoding="utf-8", errors="replace")) for p in corpus_files(cfg, split))
    return pack_documents(docs, seq_len, tok.eos_id)


def build_trainer(config: TrainerConfig, data: DataConfig, provider: ModelProvider) -> Trainer:
    """The causal-LM trainer on the packed corpus, validated on the held-out files (also used by
    ``finetune_lora.py``)."""
    seq_len = config.batching.seq_len
    return Trainer(
        config,
        provider,
        DatasetProvider(
            lambda: build_dataset(data, seq_len),
            validation=lambda: build_dataset(data, seq_len, "validation"),
        ),
        CausalLMTask(labels_to_model=True),
    )


def parse_args(argv: list[str]) -> tuple[PretrainConfig, argparse.Namespace]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="TOML/YAML/JSON config file")
    ap.add_argument("--steps", type=int, help="optimizer steps (overrides run.steps)")
    ap.add_argument("--run-dir", help="run directory (overrides run.run_dir)")
    ap.add_argument("--no-export", action="store_true", help="skip the final Hugging Face export")
    ap.add_argument(
        "--init-from", type=Path, help="start from this Hugging Face checkpoint (e.g. a seed checkpoint)"
    )
    ap.add_argument(
        "--write-seed-checkpoint",
        type=Path,
        metavar="DIR",
        help="write the freshly initialised model as a Hugging Face checkpoint to DIR and exit; every "
        "parallel layout that starts from it (--init-from DIR) starts from the same weights",
    )
    args, overrides = ap.parse_known_args(argv)
    if args.steps is not None:
        overrides.append(f"--run.steps={args.steps}")
    if args.run_dir is not None:
        overrides.append(f"--run.run_dir={args.run_dir}")
    return load_config(args.config, overrides, cls=PretrainConfig), args


def build_provider(config: PretrainConfig, init_from: Path | None = None) -> Qwen3Provider:
    """The Qwen3-MoE provider of ``config`` (weights from ``init_from``, a Hugging Face checkpoint, if given)."""
    assert config.model.vocab_size >= ByteTokenizer.vocab_size, "model.vocab_size must cover the byte tokens"
    return Qwen3Provider(
        config.model,
        parallel=config.parallel,
        init_from=init_from,
        dtype=getattr(torch, config.model_dtype),
        seed=config.run.seed,
    )


def main(argv: list[str] | None = None) -> dict[str, float]:
    config, args = parse_args(sys.argv[1:] if argv is None else argv)
    provider = build_provider(config, args.init_from)
    if args.write_seed_checkpoint is not None:
        model = provider.build_stage(0, 1)
        provider.materialize(model, "cpu")
        return {"seed_checkpoint": str(provider.export_hf([model], args.write_seed_checkpoint))}
    trainer = build_trainer(config, config.data, provider)
    try:
        summary = trainer.fit()
        if not args.no_export:
            out = provider.export_hf(trainer.model_parts, trainer.run_dir / "hf")
            if trainer.topology.is_main:
                print(f"Hugging Face checkpoint: {out}")
    finally:
        trainer.close()
    return summary


if __name__ == "__main__":
    main()
