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
``--init-from`` checkpoint's, when it has one; the export gets a copy). Validation data for the
validation loss (``[evaluation]``) is never trained on: the last ``data.validation_files`` files of the
corpus, or, when it has no more files than that (one JSONL file, say), ``data.validation_documents``
of its documents (a count or a fraction, drawn with ``data.validation_seed``: the same split on every
rank and resume); ``data.validation_split`` forces ``files`` or ``documents``,
``data.validation_source`` gives a separate corpus (see ``DataConfig``; ``data.validation_files=0``
holds out nothing, with ``evaluation.enabled=false``). The run writes ``<run_dir>/metrics.jsonl``, periodic async checkpoints under
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

import multiprocessing
import signal

if multiprocessing.current_process().name != "MainProcess":
    # A process that multiprocessing spawns from the job (DCP's checkpoint writer) imports this module
    # again, first thing: there SIGINT is ignored. A Ctrl-C reaches every process of the terminal's
    # group; the job decides what it means (finish the step, save, exit 130).
    signal.signal(signal.SIGINT, signal.SIG_IGN)

import argparse
import functools
import os
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
    DocumentHoldout,
    HFTokenizer,
    MixtureDataset,
    PackedTokens,
    Tokenizer,
    build_packed_corpus,
    build_packed_splits,
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
    """Where the text comes from, how it is read and tokenised, how it is cut, and what is held out.

    Validation data (never trained on) comes from ``validation_source`` when it is set; otherwise it is
    held out of the training source(s), by ``validation_split``:

    - ``"auto"`` (default): the last ``validation_files`` files when the source has more files than
      that, else ``validation_documents`` of its documents (one log line says so). So one JSONL file,
      or a folder of a few files, works with the defaults.
    - ``"files"``: the last ``validation_files`` files (an error when the source has no more files).
    - ``"documents"``: ``validation_documents`` documents (JSONL lines, parquet/arrow rows, chat
      records, text files) drawn by a generator seeded with ``validation_seed``, over the files read.

    The documents drawn depend on the documents and the seed only (not on the world size), so every
    rank and every resume has the same split. ``validation_files=0`` holds out nothing (with
    ``evaluation.enabled=false``), except under ``"documents"``. Token files (``format="tokens"``)
    cannot have documents held out: give them a ``validation_source``.
    """

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
    validation_split: Literal["auto", "files", "documents"] = Field(
        "auto",
        description="How validation is held out of the source: 'auto' (files when the source has more than "
        "validation_files files, else documents), 'files' or 'documents'",
    )
    validation_files: int = Field(
        8, ge=0, description="The corpus's last files (sorted by path), held out for evaluation (0: none)"
    )
    validation_documents: int | float = Field(
        0.05,
        gt=0,
        description="Documents held out when documents are: a number (an int >= 1) or a fraction (a float "
        "in (0, 1), at least one document)",
    )
    validation_seed: int = Field(0, description="Seed of the draw of the held-out documents")
    validation_source: str | None = Field(
        None,
        description="A separate validation corpus (file, directory or glob, read with data.format and "
        "data.text_field); nothing is then held out of the training source",
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
        if isinstance(self.validation_documents, float) and not self.validation_documents < 1:
            raise ValueError(
                f"data.validation_documents={self.validation_documents}: a fraction must be below 1 "
                "(give a whole number for a count of documents)"
            )
        return self

    @property
    def holds_out(self) -> bool:
        """Whether there is validation data (a separate source, or some held out of the source)."""
        return (
            self.validation_source is not None
            or self.validation_split == "documents"
            or self.validation_files > 0
        )


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


ValidationMode = Literal["files", "documents", "none"]


def _source_of(cfg: DataConfig, part: int | None) -> tuple[str, str]:
    """The source of ``data.source`` or of the ``part``-th ``[[data.mixture]]`` table, and its field name."""
    if part is None:
        return cfg.source, "data.source"
    return cfg.mixture[part].source, f"data.mixture[{part}].source"


def _all_files(cfg: DataConfig, source: str, name: str) -> list[Path]:
    """Every file of ``source`` (sorted by path); errors name the field ``name``."""
    try:
        if source == "stdlib":
            root = Path(sysconfig.get_paths()["stdlib"])
            return [p for p in resolve_source(root, cfg.pattern or "*.py") if "site-packages" not in p.parts]
        return resolve_source(source, cfg.pattern or "*")
    except DataSourceError as e:
        raise DataSourceError(str(e).replace("data.source", name, 1)) from None


def validation_mode(cfg: DataConfig, num_files: int) -> ValidationMode:
    """How validation is held out of a source of ``num_files`` files (see :class:`DataConfig`)."""
    if cfg.validation_source is not None:
        return "none"
    if cfg.validation_split == "documents":
        return "documents"
    if cfg.validation_files == 0:
        return "none"
    if cfg.validation_split == "auto" and num_files <= cfg.validation_files:
        return "documents"
    return "files"


def corpus_files(
    cfg: DataConfig, split: Literal["train", "validation"] = "train", part: int | None = None
) -> list[Path]:
    """The files that ``split`` reads of ``data.source``, or of the ``part``-th ``[[data.mixture]]``
    table's source: held out by files, the training files (the first ``max_files``) or the validation
    files (the last ``validation_files``); held out by documents (or not at all), the first
    ``max_files`` files for both (see :class:`DataConfig`).

    Raises:
        DataSourceError: a source that does not exist, is empty or has too few files (naming
            ``data.source`` or ``data.mixture[part].source``).
    """
    source, name = _source_of(cfg, part)
    files = _all_files(cfg, source, name)
    mode = validation_mode(cfg, len(files))
    if mode != "files":
        return files[: cfg.max_files]
    if len(files) <= cfg.validation_files:
        raise DataSourceError(
            f"{name}: {len(files)} file(s) in {source}, not more than data.validation_files="
            f"{cfg.validation_files} (set it lower, or data.validation_split='documents')"
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


def _packed(
    cfg: DataConfig, seq_len: int, split: Literal["train", "validation"], part: int | None
) -> PackedTokens:
    """One source's rows of ``split`` (``data.source``, or the ``part``-th mixture table's source)."""
    source, name = _source_of(cfg, part)
    mode = validation_mode(cfg, len(_all_files(cfg, source, name)))
    if mode == "documents":
        packed = _document_splits(cfg, seq_len, part)[0 if split == "train" else 1]
        if isinstance(packed, DataSourceError):  # held-out documents too few for a row
            raise packed
        return packed
    if split == "validation" and mode == "none":
        raise DataSourceError(f"{name}: nothing is held out for validation (data.validation_files=0)")
    files = corpus_files(cfg, split, part)
    fmt, text_field = _format_of(cfg, part)
    return build_packed_corpus(
        files,
        seq_len,
        build_tokenizer(cfg),
        fmt,
        text_field,
        strict_utf8=source != "stdlib",
        loss_on=cfg.loss_on,
    )


def _format_of(cfg: DataConfig, part: int | None) -> tuple[str, str]:
    """The format and text field of ``data.source`` or of the ``part``-th mixture table."""
    if part is None:
        return cfg.format, cfg.text_field
    table = cfg.mixture[part]
    return table.format, table.text_field or cfg.text_field


@functools.lru_cache(maxsize=4)
def _document_splits(
    cfg: DataConfig, seq_len: int, part: int | None
) -> tuple[PackedTokens, PackedTokens | DataSourceError]:
    """One source's documents split into training and held-out rows (read once for both; cached)."""
    source, name = _source_of(cfg, part)
    files = corpus_files(cfg, "train", part)
    holdout = DocumentHoldout(cfg.validation_documents, cfg.validation_seed)
    fmt, text_field = _format_of(cfg, part)
    train, val = build_packed_splits(
        files,
        seq_len,
        build_tokenizer(cfg),
        holdout,
        fmt,
        text_field,
        strict_utf8=source != "stdlib",
        loss_on=cfg.loss_on,
        name=name,
    )
    if cfg.validation_split == "auto" and int(os.environ.get("RANK", "0")) == 0:
        held = val.num_documents if isinstance(val, PackedTokens) else None
        what = "some" if held is None else f"{held} of its {train.num_documents + held}"
        print(
            f"{name}: {len(files)} file(s), not more than data.validation_files={cfg.validation_files}: "
            f"holding out {what} documents for validation instead "
            f"(data.validation_documents={cfg.validation_documents})",
            file=sys.stderr,
        )
    return train, val


@functools.lru_cache(maxsize=4)
def build_dataset(
    cfg: DataConfig, seq_len: int, split: Literal["train", "validation"] = "train"
) -> PackedTokens | MixtureDataset:
    """The split's documents tokenised, each ending in the end-of-document token, packed into rows of
    ``seq_len``; with ``[[data.mixture]]`` each table's source packed alone and the rows mixed by weight
    (cached: the startup check and the trainer share one read). Validation: ``data.validation_source``
    read alone, or the rows held out of each source (see :class:`DataConfig`)."""
    if split == "validation" and cfg.validation_source is not None:
        try:
            files = resolve_source(cfg.validation_source, cfg.pattern or "*")
            return build_packed_corpus(
                files, seq_len, build_tokenizer(cfg), cfg.format, cfg.text_field, loss_on=cfg.loss_on
            )
        except DataSourceError as e:
            raise DataSourceError(str(e).replace("data.source", "data.validation_source", 1)) from None
    parts: list[int | None] = [None] if not cfg.mixture else list(range(len(cfg.mixture)))
    packed = [_packed(cfg, seq_len, split, part) for part in parts]
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
            validation=(lambda: build_dataset(data, seq_len, "validation")) if data.holds_out else None,
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
    check_corpus(
        config.data,
        config.batching.seq_len,
        config.model.vocab_size,
        config.evaluation.enabled,
        global_batch_size=config.batching.global_batch_size,
    )


def check_batch_fits(
    dataset: PackedTokens | MixtureDataset, seq_len: int, global_batch_size: int, what: str
) -> None:
    """A dataset must hold one global batch of rows; ``what`` names it (``data.source``, ...).

    Raises:
        StartupError: in the user's units: records and tokens, and the rows and tokens a batch needs.
    """
    if len(dataset) >= global_batch_size:
        return
    parts = dataset.datasets if isinstance(dataset, MixtureDataset) else [dataset]
    records = sum(p.num_documents for p in parts)
    tokens = sum(len(p.tokens) for p in parts)
    raise StartupError(
        f"{what}: {records:,} record(s) ({tokens:,} tokens) pack into {len(dataset)} row(s) of "
        f"batching.seq_len={seq_len}, fewer than one global batch of batching.global_batch_size="
        f"{global_batch_size} rows ({global_batch_size * seq_len + 1:,} tokens); give more data, or lower "
        "batching.global_batch_size or batching.seq_len"
    )


def check_corpus(
    data: DataConfig, seq_len: int, vocab_size: int, evaluate: bool, *, global_batch_size: int | None = None
) -> None:
    """Read and tokenise the training (and, with ``evaluate``, the validation) corpus of ``data``, cached
    for the trainer, and check the tokenizer's ids fit ``vocab_size`` (also used by ``finetune_lora.py``)
    and, given ``global_batch_size``, that each split holds one global batch.

    Raises:
        StartupError: naming the file (and line or row) of bad input, both vocabulary sizes, or a split
            smaller than one global batch.
    """
    if not data.holds_out and evaluate:
        raise StartupError(
            "data.validation_files=0 holds out nothing for evaluation.enabled=true "
            "(or give data.validation_source, or data.validation_split='documents')"
        )
    try:
        tokenizer = build_tokenizer(data)
        if tokenizer.vocab_size > vocab_size:
            raise StartupError(
                f"data.tokenizer: {data.tokenizer} has {tokenizer.vocab_size} token ids, more than "
                f"model.vocab_size={vocab_size}"
            )
        train = build_dataset(data, seq_len)
        val = build_dataset(data, seq_len, "validation") if evaluate else None
    except DataSourceError as e:
        raise StartupError(str(e)) from None
    if global_batch_size is not None:
        source = "data.mixture" if data.mixture else "data.source"
        check_batch_fits(train, seq_len, global_batch_size, f"{source} (training)")
        if val is not None:
            check_batch_fits(val, seq_len, global_batch_size, _validation_name(data))


def _validation_name(data: DataConfig) -> str:
    """What the validation data is, for messages."""
    if data.validation_source is not None:
        return "data.validation_source"
    return f"{'data.mixture' if data.mixture else 'data.source'} (held out for validation)"


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
    if trainer.resume() is not None and trainer.step >= config.run.steps:
        # a rerun of a finished run: its summary, metrics and export stay as they are
        if trainer.topology.is_main:
            print(f"{trainer.run_dir}: already finished at step {trainer.step}; nothing to do")
        trainer.close()
        return {}
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
