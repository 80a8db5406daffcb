"""Train a decoder of any family on an embedded corpus: the Python standard library's own source files.

    uv run examples/train.py --config examples/configs/llama/cpu.toml      # CPU (CUDA when present)
    uv run examples/train.py --config examples/configs/gpt_oss/gpu1.toml   # one GPU
    uv run examples/train.py --config examples/configs/llama/cpu.toml --init-from HF_DIR
    torchrun --nproc-per-node 2 examples/train.py --config examples/configs/llama/cpu.toml --mesh.data_shard=2

The family comes from ``[model] model_type`` (Hugging Face's names: ``llama``, ``gpt_oss``,
``qwen3``, ``qwen3_moe``, ...; the other ``[model]`` keys are that family's ``config.json`` fields).
With ``--init-from HF_DIR`` the checkpoint's ``config.json`` is the model: a ``[model]`` section may
then be left out; the keys it sets must agree with the checkpoint's, except the training-only ones
(``attn_implementation``, router loss settings, ...), which override it (each override is logged).

By default byte-level tokens (no tokenizer download), documents packed into fixed-length rows with
per-document attention masking. ``[data]`` takes your own corpus: ``source`` a file, a directory or a
glob; ``format`` ``auto`` (by extension) | ``text`` | ``jsonl`` | ``parquet`` | ``arrow`` | ``tokens``
| ``chat`` (supervised fine-tuning on conversations: ``loss_on`` ``assistant`` (default) or ``all``);
``text_field``; ``[[data.mixture]]`` tables (``source``, ``format``, ``weight``, ``text_field``) mix
several sources by weight instead of ``source``; a ``python -m plait.loop.data tokenize`` output
directory is a ``tokens`` source read memory-mapped; ``tokenizer`` ``bytes`` or a directory with ``tokenizer.json`` (default: the
``--init-from`` checkpoint's, when it has one; the export gets a copy). The last
``data.validation_files`` files of the corpus are held out (never trained on) for the validation loss
(``[evaluation]``; 0 holds out nothing, with ``evaluation.enabled=false``). The run writes ``<run_dir>/metrics.jsonl``, periodic async checkpoints under
``<run_dir>/checkpoints`` (a rerun with the same run dir resumes), and at the end a Hugging Face
checkpoint in ``<run_dir>/hf`` that ``transformers.AutoModelForCausalLM.from_pretrained`` loads, a
summary (printed and in ``<run_dir>/summary.json``) and ``<run_dir>/loss_curve.png``.

FP8 training on GPUs of compute capability 8.9+ (Ada, Hopper): ``--parallel.float8.recipe=rowwise`` (or
``tensorwise``; a ``[parallel.float8]`` section in the config), with ``pip install "plait-models[float8]"``
(torchao); see plait-models' README.

Bad flags, config files, paths or data stop it with one message and exit status 2 before anything is
built. Ctrl-C / SIGTERM finish the step, save a checkpoint and exit with 130 / 143, without the
Hugging Face export of the unfinished run unless ``--export-unfinished`` is given.
"""

from __future__ import annotations

import argparse
import functools
import os
import signal
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
from plait.dist_core import parse_dtype
from plait.loop import (
    CausalLMTask,
    ConfigError,
    DatasetProvider,
    ModelProvider,
    RunDirLockedError,
    Trainer,
    TrainerConfig,
    load_config,
    split_cli_overrides,
)
from plait.loop.checkpoint import CheckpointWriteError
from plait.loop.data import (
    ByteTokenizer,
    DataSourceError,
    HFTokenizer,
    MixtureDataset,
    PackedTokens,
    Tokenizer,
    build_packed_corpus,
    copy_tokenizer_files,
    has_tokenizer,
    resolve_source,
)
from plait.loop.data.sources import DataFormat, LossOn
from plait.models import (
    CausalLMProvider,
    DecoderConfig,
    ParallelConfig,
    check_fits,
    check_float8,
    load_hf_config,
    parse_config,
)
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializeAsAny,
    ValidationError,
    field_validator,
    model_validator,
)

HERE = Path(__file__).resolve().parent
DEFAULT_CONFIG = HERE / "configs" / "llama" / "cpu.toml"


class MixtureSource(BaseModel):
    """One ``[[data.mixture]]`` table: a source and its weight in the mixture."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    source: str = Field(description="'stdlib', or a file, a directory or a glob")
    format: DataFormat = Field("auto", description="As data.format")
    weight: float = Field(gt=0, allow_inf_nan=False, description="Relative share of the rows (> 0)")
    text_field: str | None = Field(None, description="As data.text_field (None: data.text_field)")


class DataConfig(BaseModel):
    """Where the text comes from, how it is read and tokenised, and how it is cut."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    source: str = Field(
        "stdlib",
        description="'stdlib' (this Python's own library sources), or a file, a directory or a glob",
    )
    format: DataFormat = Field(
        "auto",
        description="'auto' (from each file's extension; a datasets.save_to_disk folder is arrow), "
        "'text', 'jsonl', 'parquet', 'arrow', 'tokens' (raw token files) or 'chat' (JSONL records with a "
        "'messages' list, rendered with the tokenizer's chat template)",
    )
    text_field: str = Field("text", description="The JSONL field / parquet or arrow column of the text")
    loss_on: LossOn = Field(
        "assistant",
        description="format='chat': train on the assistant tokens only ('assistant') or on every token ('all')",
    )
    pattern: str | None = Field(
        None, description="The files of a directory source ('*.py' for stdlib, else every file)"
    )
    tokenizer: str | None = Field(
        None,
        description="'bytes' or a directory with tokenizer.json; unset: --init-from's tokenizer if it has "
        "one, else bytes",
    )
    max_files: int | None = Field(
        400, ge=1, description="Cap on training files (sorted by path), None for all"
    )
    validation_files: int = Field(
        8, ge=0, description="The corpus's last files (sorted by path), held out for evaluation"
    )
    mixture: tuple[MixtureSource, ...] = Field(
        (),
        description="[[data.mixture]] tables (source, format, weight, text_field): rows drawn from several "
        "sources in proportion to their weights, instead of data.source",
    )
    mixture_seed: int = Field(0, description="Seed of the mixture's assignment of rows to sources")

    @model_validator(mode="after")
    def _one_kind_of_source(self) -> DataConfig:
        if self.mixture and "source" in self.model_fields_set:
            raise ValueError("data.source and data.mixture: give one (each mixture table names its source)")
        return self


class TrainConfig(TrainerConfig):
    """The loop's config plus the model (any family), its parallel plan and the data.

    ``model`` is None only until an ``--init-from`` checkpoint's config fills it in.
    """

    # The family of a [model] section without model_type (None: model_type is required).
    DEFAULT_MODEL_TYPE: ClassVar[str | None] = None

    model: SerializeAsAny[DecoderConfig] | None = None
    # bfloat16 parameters pair with optimizer.name = "stochastic_adamw" (stochastic rounding).
    model_dtype: Literal["float32", "bfloat16"] = "float32"
    parallel: ParallelConfig = ParallelConfig()
    data: DataConfig = DataConfig()

    @field_validator("model", mode="before")
    @classmethod
    def _family_config(cls, value: Any) -> Any:
        """A ``[model]`` table -> the config class of its ``model_type`` (unknown keys are errors)."""
        if not isinstance(value, dict):
            return value
        data = dict(value)
        if "model_type" not in data:
            if cls.DEFAULT_MODEL_TYPE is None:
                raise ValueError("model.model_type is required (e.g. 'llama', 'gpt_oss', 'qwen3_moe')")
            data["model_type"] = cls.DEFAULT_MODEL_TYPE
        try:
            return parse_config(data)
        except ValidationError as e:
            raise ValueError("; ".join(_describe(err) for err in e.errors())) from None

    @model_validator(mode="after")
    def _check_model_against_run(self) -> TrainConfig:
        """Conflicts between the model section and the others, each naming both fields."""
        m = self.model
        if m is None:
            return self
        if self.batching.seq_len > m.max_position_embeddings:
            raise ValueError(
                f"batching.seq_len={self.batching.seq_len} is larger than "
                f"model.max_position_embeddings={m.max_position_embeddings}"
            )
        if self.data.tokenizer in (None, "bytes") and m.vocab_size < ByteTokenizer.vocab_size:
            raise ValueError(
                f"model.vocab_size={m.vocab_size} is smaller than the byte tokenizer's "
                f"{ByteTokenizer.vocab_size} token ids (data: byte-level tokens)"
            )
        stages = self.num_pipeline_stages
        if stages > m.num_hidden_layers:
            raise ValueError(
                f"model.num_hidden_layers={m.num_hidden_layers} is fewer than the {stages} pipeline stages of "
                f"mesh.pipeline={self.mesh.pipeline} x the schedule's stages per rank (pipeline.kind)"
            )
        if stages > 1 and m.tie_word_embeddings:
            raise ValueError(
                "model.tie_word_embeddings=true cannot be split over pipeline stages "
                f"(mesh.pipeline={self.mesh.pipeline}); set it to false"
            )
        return self


def corpus_files(
    cfg: DataConfig, split: Literal["train", "validation"] = "train", part: int | None = None
) -> list[Path]:
    """The training files (the first ``max_files``) or the held-out validation files (the last ones) of
    ``data.source``, or of the ``part``-th ``[[data.mixture]]`` table's source.

    Raises:
        DataSourceError: a source that does not exist, is empty or has too few files (naming
            ``data.source`` or ``data.mixture[part].source``).
    """
    source = cfg.source if part is None else cfg.mixture[part].source
    name = "data.source" if part is None else f"data.mixture[{part}].source"
    try:
        if source == "stdlib":
            root = Path(sysconfig.get_paths()["stdlib"])
            files = [p for p in resolve_source(root, cfg.pattern or "*.py") if "site-packages" not in p.parts]
        else:
            files = resolve_source(source, cfg.pattern or "*")
    except DataSourceError as e:
        raise DataSourceError(str(e).replace("data.source", name, 1)) from None
    if len(files) <= cfg.validation_files:
        raise DataSourceError(
            f"{name}: {len(files)} file(s) in {source}, not more than "
            f"data.validation_files={cfg.validation_files} (set it lower, or 0 with evaluation.enabled=false)"
        )
    n = len(files) - cfg.validation_files
    return files[:n][: cfg.max_files] if split == "train" else files[n:]


def build_tokenizer(cfg: DataConfig) -> Tokenizer:
    """The byte tokenizer, or the Hugging Face tokenizer of directory ``cfg.tokenizer``.

    Raises:
        DataSourceError: a directory without ``tokenizer.json`` or a tokenizer that cannot be used.
    """
    if cfg.tokenizer in (None, "bytes"):
        return ByteTokenizer()
    if not has_tokenizer(cfg.tokenizer):
        raise DataSourceError(f"data.tokenizer: {cfg.tokenizer} holds no tokenizer.json (or give 'bytes')")
    try:
        return HFTokenizer(cfg.tokenizer)
    except (ImportError, ValueError) as e:
        raise DataSourceError(f"data.tokenizer: {e}") from None


@functools.lru_cache(maxsize=4)
def build_dataset(
    cfg: DataConfig, seq_len: int, split: Literal["train", "validation"] = "train"
) -> PackedTokens | MixtureDataset:
    """The split's documents tokenised, each ending in the end-of-document token, packed into rows of
    ``seq_len``; with ``[[data.mixture]]`` each table's source packed alone and the rows mixed by weight
    (cached: the startup check and the trainer share one read)."""
    tokenizer = build_tokenizer(cfg)
    parts = [(None, cfg.source, cfg.format, cfg.text_field)] if not cfg.mixture else [
        (i, m.source, m.format, m.text_field or cfg.text_field) for i, m in enumerate(cfg.mixture)
    ]  # fmt: skip
    packed = [
        build_packed_corpus(
            corpus_files(cfg, split, part),
            seq_len,
            tokenizer,
            fmt,
            text_field,
            strict_utf8=source != "stdlib",
            loss_on=cfg.loss_on,
        )
        for part, source, fmt, text_field in parts
    ]
    if not cfg.mixture:
        return packed[0]
    return MixtureDataset(packed, [m.weight for m in cfg.mixture], seed=cfg.mixture_seed)


def build_trainer(config: TrainerConfig, data: DataConfig, provider: ModelProvider) -> Trainer:
    """The causal-LM trainer on the packed corpus, validated on the held-out files (also used by
    ``finetune_lora.py``)."""
    seq_len = config.batching.seq_len
    return Trainer(
        config,
        provider,
        DatasetProvider(
            lambda: build_dataset(data, seq_len),
            validation=(lambda: build_dataset(data, seq_len, "validation"))
            if data.validation_files
            else None,
        ),
        CausalLMTask(labels_to_model=True),
    )


def build_and_resume(config: TrainerConfig, data: DataConfig, provider: ModelProvider) -> Trainer:
    """:func:`build_trainer`, then its newest checkpoint loaded (``fit()`` would, but here a refused
    resume is a start-up error): the trainer is closed and the ``ConfigError`` raised."""
    trainer = build_trainer(config, data, provider)
    try:
        trainer.resume()
    except ConfigError:  # a resume this config may not make
        trainer.close()
        raise
    return trainer


def _describe(err: Any) -> str:
    loc = ".".join(str(p) for p in err["loc"])
    msg = str(err["msg"]).removeprefix("Value error, ")
    return f"{loc}: {msg} (got {err.get('input')!r})" if loc else msg


class StartupError(Exception):
    """A flag, file or path that keeps the job from starting; the message says which and why."""


def parse_args(
    argv: list[str], cls: type[TrainConfig] = TrainConfig, default_config: Path = DEFAULT_CONFIG
) -> tuple[TrainConfig, argparse.Namespace]:
    """Flags and dotted ``--section.field=value`` overrides -> the config and the flags.

    Raises:
        ConfigError: a missing or bad config file, or an override that does not validate.
        StartupError: an ``--init-from`` that is not a checkpoint or disagrees with ``[model]``.
        SystemExit: an unknown or misspelt flag (argparse's message, status 2).
    """
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    ap.add_argument("--config", type=Path, default=default_config, help="TOML/YAML/JSON config file")
    ap.add_argument("--steps", type=int, help="optimizer steps (overrides run.steps)")
    ap.add_argument("--run-dir", help="run directory (overrides run.run_dir)")
    ap.add_argument("--no-export", action="store_true", help="skip the final Hugging Face export")
    ap.add_argument(
        "--export-unfinished",
        action="store_true",
        help="write the Hugging Face export also when a signal stops the run before run.steps",
    )
    ap.add_argument(
        "--init-from",
        type=Path,
        help="start from this Hugging Face checkpoint (its config.json is the model; e.g. a seed checkpoint)",
    )
    ap.add_argument(
        "--write-seed-checkpoint",
        type=Path,
        metavar="DIR",
        help="write the freshly initialised model as a Hugging Face checkpoint to DIR and exit; every "
        "parallel layout that starts from it (--init-from DIR) starts from the same weights",
    )
    overrides, rest = split_cli_overrides(argv)
    args = ap.parse_args(rest)  # anything else, e.g. "--step 3" for "--steps 3", is an error
    if args.steps is not None:
        overrides.append(f"--run.steps={args.steps}")
    if args.run_dir is not None:
        overrides.append(f"--run.run_dir={args.run_dir}")
    config = load_config(args.config, overrides, cls=cls)
    if args.init_from is not None:  # raises StartupError
        config = adopt_checkpoint_config(config, args.init_from)
        if config.data.tokenizer is None and has_tokenizer(args.init_from):
            config = config.model_copy(
                update={"data": config.data.model_copy(update={"tokenizer": str(args.init_from)})}
            )
    elif config.model is None:
        raise ConfigError(
            f"{args.config}: no [model] section (give one with model_type, or --init-from HF_DIR)"
        )
    return config, args


def adopt_checkpoint_config(config: TrainConfig, init_from: Path) -> TrainConfig:
    """The run's config with ``init_from``'s ``config.json`` as the model.

    Keys of the run's ``[model]`` section (file or ``--model.*`` overrides) that are training-only
    (the family config's ``training_only_fields``) override the checkpoint's, each logged; any other key must agree.

    Raises:
        StartupError: not a checkpoint directory, no readable ``config.json``, or ``[model]`` keys that disagree with it (each named,
            with both values).
    """
    if not init_from.is_dir():
        raise StartupError(f"--init-from: {init_from} is not a directory")
    if not any(init_from.glob("*.safetensors")):
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
    try:
        return type(config).model_validate({**config.model_dump(), "model": model})
    except ValidationError as e:
        raise ConfigError("; ".join(_describe(err) for err in e.errors())) from None


def check_paths(config: TrainConfig, args: argparse.Namespace) -> None:
    """Fail before anything is built: the corpus must have files, the run directory (and the checkpoint directory) must be writable.

    Raises:
        StartupError: naming the flag or field and the path.
    """
    assert config.model is not None
    device = (
        config.run.device if config.run.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    )
    try:
        check_fits(
            config.model, device, parse_dtype(config.model_dtype), int(os.environ.get("WORLD_SIZE", 1))
        )
    except ValueError as e:
        raise StartupError(f"model: {e}") from None
    if args.write_seed_checkpoint is None:
        check_data(config)
    dirs = {"run.run_dir": config.run.run_dir}
    if config.checkpoint.enabled and config.checkpoint.dir:
        dirs["checkpoint.dir"] = config.checkpoint.dir
    if args.write_seed_checkpoint is not None:
        dirs = {"--write-seed-checkpoint": str(args.write_seed_checkpoint)}
    for name, path in dirs.items():
        try:
            Path(path).mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=path, prefix=".write_test"):
                pass
        except OSError as e:
            raise StartupError(f"{name}: cannot write to {path}: {e.strerror or e}") from None


def check_data(config: TrainConfig) -> None:
    """Read and tokenise the corpus (cached for the trainer) and check the tokenizer fits the model.

    Raises:
        StartupError: naming the file (and line or row) of bad input, or both vocabulary sizes.
    """
    assert config.model is not None
    check_corpus(config.data, config.batching.seq_len, config.model.vocab_size, config.evaluation.enabled)


def check_corpus(data: DataConfig, seq_len: int, vocab_size: int, evaluate: bool) -> None:
    """Read and tokenise the training (and, with ``evaluate``, the validation) corpus of ``data``, cached
    for the trainer, and check the tokenizer's ids fit ``vocab_size`` (also used by ``finetune_lora.py``).

    Raises:
        StartupError: naming the file (and line or row) of bad input, or both vocabulary sizes.
    """
    if data.validation_files == 0 and evaluate:
        raise StartupError("data.validation_files=0 holds out nothing for evaluation.enabled=true")
    try:
        tokenizer = build_tokenizer(data)
        if tokenizer.vocab_size > vocab_size:
            raise StartupError(
                f"data.tokenizer: {data.tokenizer} has {tokenizer.vocab_size} token ids, more than "
                f"model.vocab_size={vocab_size}"
            )
        build_dataset(data, seq_len)
        if evaluate:
            build_dataset(data, seq_len, "validation")
    except DataSourceError as e:
        raise StartupError(str(e)) from None


def build_provider(config: TrainConfig, init_from: Path | None = None) -> CausalLMProvider:
    """The model provider of ``config`` (weights from ``init_from``, a Hugging Face checkpoint, if given)."""
    assert config.model is not None
    return CausalLMProvider(
        config.model,
        parallel=config.parallel,
        init_from=init_from,
        dtype=parse_dtype(config.model_dtype),
        seed=config.run.seed,
    )


def check_float8_config(config: TrainConfig) -> None:
    """FP8 training (``[parallel.float8]``) needs torchao and a GPU with float8 GEMMs: said before
    anything is built.

    Raises:
        ConfigError: torchao missing (names the extra) or no float8-capable device.
    """
    try:
        check_float8(config.parallel.float8)
    except (ImportError, RuntimeError) as e:
        raise ConfigError(str(e)) from None


def main(
    argv: list[str] | None = None, cls: type[TrainConfig] = TrainConfig, default_config: Path = DEFAULT_CONFIG
) -> dict[str, float]:
    """Run the job; returns the last logged metrics.

    Raises:
        SystemExit: 2 on a bad flag, config or path (one message on stderr, nothing built), a run
            directory in use or a checkpoint this config may not resume; 1 on a checkpoint that could
            not be written (one message: which, where, why, what was kept); 128 +
            the signal number (130 for Ctrl-C, 143 for SIGTERM) when a signal stopped the run.
    """
    try:
        config, args = parse_args(sys.argv[1:] if argv is None else argv, cls, default_config)
        check_paths(config, args)
        check_float8_config(config)
    except (ConfigError, StartupError) as e:
        print(f"{Path(sys.argv[0]).name}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    provider = build_provider(config, args.init_from)
    if args.write_seed_checkpoint is not None:
        model = provider.build_stage(0, 1)
        provider.materialize(model, "cpu")
        return {"seed_checkpoint": str(provider.export_hf([model], args.write_seed_checkpoint))}
    try:
        trainer = build_and_resume(config, config.data, provider)  # takes the run dir's lock
    except (ConfigError, RunDirLockedError) as e:  # a config or resume refused; a run dir in use
        print(f"{Path(sys.argv[0]).name}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    try:
        summary = trainer.fit()
        if args.no_export:
            pass
        elif trainer.stop_signal is not None and not args.export_unfinished:
            if trainer.topology.is_main:
                print(
                    f"stopped by {signal.Signals(trainer.stop_signal).name} at step {trainer.step}: "
                    "no Hugging Face export of the unfinished run (--export-unfinished writes it)",
                    file=sys.stderr,
                )
        else:
            out = provider.export_hf(trainer.model_parts, trainer.run_dir / "hf")
            if config.data.tokenizer not in (None, "bytes") and trainer.topology.is_main:
                copy_tokenizer_files(config.data.tokenizer, out)  # AutoTokenizer loads the export
            trainer.run_summary.export = out
            if trainer.topology.is_main:
                print(f"Hugging Face checkpoint: {out}")
    except KeyboardInterrupt:  # Ctrl-C with checkpointing (and so the signal handler) off
        trainer.stop_signal = signal.SIGINT
        summary = {}
    except CheckpointWriteError as e:  # a full disk: the message says which checkpoint, path, what was kept
        print(f"{Path(sys.argv[0]).name}: error: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    finally:
        trainer.close()
    if trainer.stop_signal is not None:
        sys.stdout.flush()
        raise SystemExit(128 + trainer.stop_signal)
    return summary


if __name__ == "__main__":
    main()
