"""Building a training job: the model provider, the data and the task of a :class:`JobConfig`, checked
before anything large is built; :func:`build_job` returns them as one frozen :class:`TrainingJob`."""

from __future__ import annotations

import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from plait.dist_core import parse_dtype
from plait.loop import CausalLMTask, ConfigError, DatasetProvider, ModelProvider, Trainer, TrainerConfig
from plait.loop.data import Corpus, DataConfig, DataSourceError, has_tokenizer
from plait.models import CausalLMProvider, check_fits, check_float8, load_hf_config
from plait.train.config import JobConfig, StartupError, describe_errors
from pydantic import ValidationError

__all__ = [
    "TrainingJob",
    "adopt_checkpoint_config",
    "build_job",
    "build_provider",
    "check_corpus",
    "check_startup",
    "data_provider",
]


@dataclass(frozen=True)
class TrainingJob:
    """What :func:`build_job` built: the config, the model provider, the data and the task.

    Nothing here holds GPU memory yet: :meth:`trainer` builds the model stages (through ``provider``),
    the optimizer and the loaders, and :meth:`Trainer.fit` runs the job.
    """

    config: TrainerConfig
    provider: ModelProvider
    corpus: Corpus
    data: DatasetProvider
    task: CausalLMTask
    init_from: Path | None = None

    def trainer(self, *, resume: bool = True) -> Trainer:
        """The trainer of this job; with ``resume``, its newest checkpoint loaded now (a refused resume is
        then a start-up error, raised as ``ConfigError`` after the trainer is closed)."""
        trainer = Trainer(self.config, self.provider, self.data, self.task)
        if resume:
            try:
                trainer.resume()
            except ConfigError:  # a resume this config may not make
                trainer.close()
                raise
        return trainer


def data_provider(corpus: Corpus) -> DatasetProvider:
    """The training and (when some is held out) validation rows of ``corpus``, as the trainer reads them."""
    return DatasetProvider(
        lambda: corpus.split("train"),
        validation=(lambda: corpus.split("validation")) if corpus.cfg.holds_out else None,
    )


NO_MODEL = "no [model] section (give one with model_type, or --init-from HF_DIR)"


def build_provider(config: JobConfig, init_from: Path | None = None) -> CausalLMProvider:
    """The model provider of ``config`` (weights from ``init_from``, a Hugging Face checkpoint, if given)."""
    if config.model is None:
        raise ConfigError(NO_MODEL)
    return CausalLMProvider(
        config.model,
        parallel=config.parallel,
        init_from=init_from,
        dtype=parse_dtype(config.model_dtype),
        seed=config.run.seed,
    )


def build_job(
    config: TrainerConfig,
    data: DataConfig,
    provider: ModelProvider,
    *,
    init_from: Path | None = None,
    corpus: Corpus | None = None,
) -> TrainingJob:
    """The job of ``config`` on ``data`` with the model of ``provider`` (a causal-LM task on packed rows).

    ``corpus`` is the one :func:`check_corpus` read (so the data is read once); None reads it when the
    trainer asks. Any config with ``run``/``batching``/... sections works: :class:`JobConfig`, or a
    fine-tuning config with its own model section.
    """
    corpus = corpus if corpus is not None else Corpus(data, config.batching.seq_len)
    return TrainingJob(
        config, provider, corpus, data_provider(corpus), CausalLMTask(labels_to_model=True), init_from
    )


def adopt_checkpoint_config(config: JobConfig, init_from: Path, *, weights: bool = True) -> JobConfig:
    """The run's config with ``init_from``'s ``config.json`` as the model, and its tokenizer as the data's
    when ``data.tokenizer`` is unset and it has one.

    Keys of the run's ``[model]`` section (file or ``--model.*`` overrides) that are training-only
    (the family config's ``training_only_fields``) override the checkpoint's, each logged; any other key
    must agree. ``weights=False`` (``plait plan``) needs the ``config.json`` only, not the safetensors.

    Raises:
        StartupError: not a checkpoint directory, no readable ``config.json``, or ``[model]`` keys that
            disagree with it (each named, with both values).
        ConfigError: the checkpoint's model does not fit the run's other sections.
    """
    if not init_from.is_dir():
        raise StartupError(f"--init-from: {init_from} is not a directory")
    if weights and not any(init_from.glob("*.safetensors")):
        raise StartupError(
            f"--init-from: {init_from} holds no *.safetensors files (expected a Hugging Face checkpoint)"
        )
    try:
        ckpt = load_hf_config(init_from)
    except (FileNotFoundError, ValueError) as e:
        raise StartupError(f"--init-from: {e}") from None
    updates: dict[str, Any] = {}
    mismatches = []
    if config.model is not None:
        for name in sorted(config.model.model_fields_set):
            mine, theirs = getattr(config.model, name), getattr(ckpt, name, None)
            if mine == theirs:
                continue
            if name in type(ckpt).training_only_fields:
                updates[name] = mine
                print(
                    f"--init-from: model.{name}={mine!r} overrides the checkpoint's {theirs!r}",
                    file=sys.stderr,
                )
            else:
                mismatches.append(
                    f"model.{name}: the run sets {mine!r}, {init_from}/config.json has {theirs!r}"
                )
    if mismatches:
        raise StartupError(
            "the [model] section disagrees with the --init-from checkpoint (drop these keys to take the "
            "checkpoint's):\n  " + "\n  ".join(mismatches)
        )
    model = type(ckpt).model_validate({**ckpt.model_dump(), **updates})
    data = config.data
    if data.tokenizer is None and has_tokenizer(init_from):
        data = data.model_copy(update={"tokenizer": str(init_from)})
    try:
        return type(config).model_validate({**config.model_dump(), "model": model, "data": data})
    except ValidationError as e:
        raise ConfigError(describe_errors(e)) from None


def _device(config: TrainerConfig) -> str:
    if config.run.device != "auto":
        return config.run.device
    return "cuda" if torch.cuda.is_available() else "cpu"


def check_corpus(
    data: DataConfig, seq_len: int, vocab_size: int, evaluate: bool, *, global_batch_size: int
) -> Corpus:
    """Read and tokenise the training (and, with ``evaluate``, the validation) data, check that the
    tokenizer fits ``vocab_size`` and that each split holds one global batch; the corpus, read.

    Raises:
        StartupError: naming the file (and line or row) of bad input, both vocabulary sizes, or a split
            smaller than one global batch.
    """
    corpus = Corpus(data, seq_len)
    try:
        corpus.check(vocab_size, evaluate, global_batch_size)
    except DataSourceError as e:
        raise StartupError(str(e)) from None
    return corpus


def check_startup(config: JobConfig, *, write_dirs: dict[str, str], read_data: bool = True) -> Corpus | None:
    """Fail before anything large is built: the model fits the device, FP8 can run, the data reads and
    fits the model and the batch (the corpus is returned, read), and ``write_dirs`` (flag or field ->
    directory) are writable.

    Raises:
        StartupError: naming the flag or field, and the path or value.
        ConfigError: FP8 training without torchao (names the extra) or without a float8 GPU; CUDA graphs
            off CUDA.
    """
    assert config.model is not None
    device = _device(config)
    try:
        check_fits(config.model, device, parse_dtype(config.model_dtype), _world_size())
    except ValueError as e:
        raise StartupError(f"model: {e}") from None
    try:
        check_float8(config.parallel.float8)
    except (ImportError, RuntimeError) as e:
        raise ConfigError(str(e)) from None
    if config.parallel.cuda_graphs and device != "cuda":
        raise ConfigError(
            f"parallel.cuda_graphs needs run.device=cuda, got {device!r} (set parallel.cuda_graphs=false)"
        )
    corpus = None
    if read_data:
        corpus = check_corpus(
            config.data,
            config.batching.seq_len,
            config.model.vocab_size,
            config.evaluation.enabled,
            global_batch_size=config.batching.global_batch_size,
        )
    for name, path in write_dirs.items():
        check_writable(name, path)
    return corpus


def check_writable(name: str, path: str | Path) -> None:
    """``path`` (created if missing) takes files; else a :class:`StartupError` naming ``name``."""
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write_test"):
            pass
    except OSError as e:
        raise StartupError(f"{name}: cannot write to {path}: {e.strerror or e}") from None


def _world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", 1))
