"""``plait finetune``: LoRA fine-tuning of a Hugging Face checkpoint of any plait family; exports a
Hugging Face PEFT adapter.

    plait finetune --base runs/qwen3_moe/hf --steps 30 --run-dir runs/lora
    plait finetune --base DIR --lora.r=16 --lora.target_parameters='["gate_up_proj"]'
    plait finetune --base DIR --config examples/sft/configs/lora.toml --data.source=chats.jsonl

The base weights load straight into the LoRA-injected model (base keys are mapped onto the
``base_layer`` names); only the adapters train. At the end ``<run_dir>/adapter`` holds
``adapter_model.safetensors`` + ``adapter_config.json``, which ``peft.PeftModel.from_pretrained``
loads onto the transformers model of the base checkpoint. Data: as in ``plait train``, with ``--base``'s
tokenizer as the default ``data.tokenizer`` when it has one (the adapter directory gets a copy); chat
data trains on the assistant tokens. The data is read and checked before the model is built.

A bad flag, override, config file or ``--base`` directory, a run directory in use by another run, or a
checkpoint in the run directory that this config may not resume stops it with one message and exit
status 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import ClassVar

from plait.loop import ConfigError, RunDirLockedError, TrainerConfig, load_config, split_cli_overrides
from plait.loop.data import DataConfig, copy_tokenizer_files, has_tokenizer
from plait.models import CausalLMProvider, CausalLMStage, hf_module_names, hf_to_plait_mapper, load_hf_config
from plait.peft import LoRAConfig, apply_peft, export_hf_adapter, load_base_checkpoint
from plait.train.config import StartupError
from plait.train.job import build_job, check_corpus
from plait.train.train import fail
from torch import nn

__all__ = ["DEFAULTS", "FinetuneConfig", "LoRAProvider", "main", "parse_args"]

DEFAULTS = {
    "run": {"name": "qwen3-lora", "run_dir": "runs/qwen3_lora", "steps": 30},
    "batching": {"global_batch_size": 8, "microbatch_size": 8, "seq_len": 256},
    "optimizer": {"lr": 1e-3, "weight_decay": 0.0},
    "logging": {"interval": 5},
    "lora": {"r": 8, "alpha": 16, "target_modules": r".*\.(q_proj|k_proj|v_proj|o_proj)"},
}
"""The settings under a ``--config`` file (or without one)."""


class FinetuneConfig(TrainerConfig):
    """The loop's config plus the LoRA method and the data (the model is the ``--base`` checkpoint's)."""

    # the adapters' shapes and targets may not change on resume either
    fixed_on_resume: ClassVar[tuple[str, ...]] = (*TrainerConfig.fixed_on_resume, "lora")

    lora: LoRAConfig
    data: DataConfig = DataConfig()


class LoRAProvider(CausalLMProvider):
    """A model provider (any family) whose stages get LoRA adapters and load their base weights from ``base``."""

    def __init__(self, base: Path, lora: LoRAConfig, seed: int) -> None:
        super().__init__(load_hf_config(base), seed=seed)
        self.base = base
        self.lora = lora

    def build_stage(self, stage_index: int, num_stages: int) -> CausalLMStage:
        stage = super().build_stage(stage_index, num_stages)
        apply_peft(stage, self.lora)  # on the meta device; everything but the adapters is frozen
        return stage

    def load_initial_weights(self, modules: Sequence[nn.Module]) -> None:
        for m in modules:
            # base weights overwrite the seeded init; adapters start again from their own init (zero B)
            load_base_checkpoint(m, self.base, hf_to_plait_mapper(self.config), reinit_adapters=True)


def parse_args(argv: list[str], prog: str = "plait finetune") -> tuple[FinetuneConfig, argparse.Namespace]:
    """Flags and dotted overrides -> the config and the flags.

    Raises:
        ConfigError: a missing or bad config file, or an override that does not validate.
        SystemExit: an unknown flag or a missing ``--base`` (argparse's message, status 2).
    """
    ap = argparse.ArgumentParser(
        prog=prog,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    ap.add_argument("--base", type=Path, required=True, help="Hugging Face checkpoint directory to fine-tune")
    ap.add_argument("--config", type=Path, help="TOML/YAML/JSON config file (defaults are built in)")
    ap.add_argument("--steps", type=int, help="optimizer steps (overrides run.steps)")
    ap.add_argument("--run-dir", help="run directory (overrides run.run_dir)")
    overrides, rest = split_cli_overrides(argv, FinetuneConfig)
    args = ap.parse_args(rest)  # unknown or misspelt flags are errors
    if args.steps is not None:
        overrides.append(f"--run.steps={args.steps}")
    if args.run_dir is not None:
        overrides.append(f"--run.run_dir={args.run_dir}")
    config = load_config(args.config, overrides, cls=FinetuneConfig, base=DEFAULTS)
    if config.data.tokenizer is None and has_tokenizer(args.base):
        config = config.model_copy(
            update={"data": config.data.model_copy(update={"tokenizer": str(args.base)})}
        )
    return config, args


def build_provider(config: FinetuneConfig, base: Path) -> LoRAProvider:
    """The LoRA provider on the checkpoint ``base``.

    Raises:
        StartupError: ``base`` is not a Hugging Face checkpoint directory (naming ``--base`` and the path).
    """
    if not base.is_dir():
        raise StartupError(f"--base: {base} is not a directory")
    if not any(base.glob("*.safetensors")):
        raise StartupError(
            f"--base: {base} holds no *.safetensors files (expected a Hugging Face checkpoint)"
        )
    try:
        return LoRAProvider(base, config.lora, config.run.seed)
    except (OSError, ValueError) as e:  # config.json missing, unreadable or not a supported model
        raise StartupError(f"--base: {base}: {e}") from None


def main(argv: list[str] | None = None, prog: str = "plait finetune") -> Path:
    """Fine-tune; returns the adapter directory.

    Raises:
        SystemExit: 2 on a bad flag, config, ``--base``, data, a run directory in use, or a checkpoint
            this config may not resume (one message on stderr).
    """
    try:
        config, args = parse_args(sys.argv[1:] if argv is None else argv, prog)
        provider = build_provider(config, args.base)  # reads config.json, builds nothing
        corpus = check_corpus(
            config.data,
            config.batching.seq_len,
            provider.config.vocab_size,
            config.evaluation.enabled,
            global_batch_size=config.batching.global_batch_size,
        )
        trainer = build_job(config, config.data, provider, corpus=corpus).trainer()
    except (ConfigError, StartupError, RunDirLockedError) as e:
        raise fail(prog, e) from None
    try:
        trainer.fit()
        out = trainer.run_dir / "adapter"
        # a collective with FSDP-sharded adapters: every rank gathers, rank 0 writes
        to_hf = hf_module_names(provider.config)[0]  # module names as transformers' model has them
        export_hf_adapter(trainer.model_parts[0], out, name_map=to_hf, base_model_name_or_path=str(args.base))
        if trainer.topology.is_main:
            if config.data.tokenizer not in (None, "bytes"):
                copy_tokenizer_files(config.data.tokenizer, out)
            print(f"PEFT adapter: {out}")
        trainer.run_summary.export = out
    finally:
        trainer.close()
    return out
