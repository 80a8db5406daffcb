"""A job's corpus: the training and validation rows that a :class:`DataConfig` describes, each read once."""

from __future__ import annotations

import json
import os
import sys
import sysconfig
from pathlib import Path
from typing import Literal

from plait.loop.data.config import DataConfig
from plait.loop.data.formats import AUTO, data_format
from plait.loop.data.mixture import MixtureDataset
from plait.loop.data.packing import PackedTokens
from plait.loop.data.sources import (
    DataSourceError,
    DocumentHoldout,
    build_packed_corpus,
    build_packed_splits,
    resolve_source,
)
from plait.loop.data.tokenize import META_FILE, is_tokenized_dir
from plait.loop.data.tokenizers import ByteTokenizer, HFTokenizer, Tokenizer, has_tokenizer

__all__ = [
    "Corpus",
    "Split",
    "ValidationMode",
    "build_tokenizer",
    "corpus_files",
    "recorded_tokenizer",
    "validation_mode",
]

Split = Literal["train", "validation"]
ValidationMode = Literal["files", "documents", "none"]
Dataset = PackedTokens | MixtureDataset


def _source_of(cfg: DataConfig, part: int | None) -> tuple[str, str]:
    """The source of ``data.source`` or of the ``part``-th ``[[data.mixture]]`` table, and its field name."""
    if part is None:
        return cfg.source, "data.source"
    return cfg.mixture[part].source, f"data.mixture[{part}].source"


def _format_of(cfg: DataConfig, part: int | None) -> tuple[str, str]:
    """The format and text field of ``data.source`` or of the ``part``-th mixture table."""
    if part is None:
        return cfg.format, cfg.text_field
    table = cfg.mixture[part]
    return table.format, table.text_field or cfg.text_field


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


def corpus_files(cfg: DataConfig, split: Split = "train", part: int | None = None) -> list[Path]:
    """The files that ``split`` reads of ``data.source``, or of the ``part``-th ``[[data.mixture]]``
    table's source: held out by files, the training files (the first ``max_files``) or the validation
    files (the last ``validation_files``); held out by documents (or not at all), the first
    ``max_files`` files for both (see :class:`DataConfig`).

    Raises:
        DataSourceError: a source that does not exist, is empty or has too few files (naming
            ``data.source`` or ``data.mixture[part].source``).
    """
    source, name = _source_of(cfg, part)
    return _split_files(cfg, _all_files(cfg, source, name), split, source, name)


def _split_files(cfg: DataConfig, files: list[Path], split: Split, source: str, name: str) -> list[Path]:
    """:func:`corpus_files` of an already listed source."""
    if validation_mode(cfg, len(files)) != "files":
        return files[: cfg.max_files]
    if len(files) <= cfg.validation_files:
        raise DataSourceError(
            f"{name}: {len(files)} file(s) in {source}, not more than data.validation_files="
            f"{cfg.validation_files} (set it lower, or data.validation_split='documents')"
        )
    n = len(files) - cfg.validation_files
    return files[:n][: cfg.max_files] if split == "train" else files[n:]


def recorded_tokenizer(cfg: DataConfig) -> str | None:
    """The tokenizer that the ``meta.json`` of a tokenized ``data.source`` records, if it is one."""
    path = Path(cfg.source)
    tokens = cfg.format == AUTO or data_format(cfg.format).holds == "tokens"
    if cfg.mixture or not tokens or not is_tokenized_dir(path):
        return None
    try:
        recorded = json.loads((path / META_FILE).read_text()).get("tokenizer")
    except (OSError, ValueError):
        return None
    return (
        recorded if isinstance(recorded, str) and (recorded == "bytes" or has_tokenizer(recorded)) else None
    )


def build_tokenizer(cfg: DataConfig) -> Tokenizer:
    """``data.tokenizer``: the byte tokenizer or the Hugging Face tokenizer of a directory; unset, the one
    a tokenized source records (:func:`recorded_tokenizer`), else bytes.

    Raises:
        DataSourceError: a directory without ``tokenizer.json`` or a tokenizer that cannot be used.
    """
    name = cfg.tokenizer if cfg.tokenizer is not None else recorded_tokenizer(cfg)
    if name in (None, "bytes"):
        return ByteTokenizer()
    if not has_tokenizer(name):
        raise DataSourceError(f"data.tokenizer: {name} holds no tokenizer.json (or give 'bytes')")
    try:
        return HFTokenizer(name)
    except (ImportError, ValueError) as e:
        raise DataSourceError(f"data.tokenizer: {e}") from None


class Corpus:
    """The rows of ``cfg`` packed to ``seq_len``, per split, each read and tokenised once.

    Each document is tokenised and ends in the end-of-document token; documents are packed into rows of
    ``seq_len``; with ``[[data.mixture]]`` each table's source is packed alone and the rows mixed by
    weight. Validation: ``data.validation_source`` read alone, or the rows held out of each source (see
    :class:`DataConfig`). The start-up check and the trainer share one object, so one read.
    """

    def __init__(self, cfg: DataConfig, seq_len: int) -> None:
        self.cfg = cfg
        self.seq_len = seq_len
        self._splits: dict[Split, Dataset] = {}
        self._documents: dict[int | None, tuple[PackedTokens, PackedTokens | DataSourceError]] = {}
        self._tokenizer: Tokenizer | None = None

    @property
    def tokenizer(self) -> Tokenizer:
        """The tokenizer of the data (:func:`build_tokenizer`, built once)."""
        if self._tokenizer is None:
            self._tokenizer = build_tokenizer(self.cfg)
        return self._tokenizer

    def split(self, split: Split = "train") -> Dataset:
        """The rows of ``split`` (read on the first call).

        Raises:
            DataSourceError: bad or too little input, naming the field and the file (and line or row).
        """
        if split not in self._splits:
            self._splits[split] = self._read(split)
        return self._splits[split]

    def _read(self, split: Split) -> Dataset:
        cfg = self.cfg
        if split == "validation" and cfg.validation_source is not None:
            try:
                files = resolve_source(cfg.validation_source, cfg.pattern or "*")
                return build_packed_corpus(
                    files, self.seq_len, self.tokenizer, cfg.format, cfg.text_field, loss_on=cfg.loss_on
                )
            except DataSourceError as e:
                raise DataSourceError(str(e).replace("data.source", "data.validation_source", 1)) from None
        parts: list[int | None] = [None] if not cfg.mixture else list(range(len(cfg.mixture)))
        packed = [self._packed(split, part) for part in parts]
        if not cfg.mixture:
            return packed[0]
        return MixtureDataset(packed, [m.weight for m in cfg.mixture], seed=cfg.mixture_seed)

    def _packed(self, split: Split, part: int | None) -> PackedTokens:
        """One source's rows of ``split`` (``data.source``, or the ``part``-th mixture table's source)."""
        cfg = self.cfg
        source, name = _source_of(cfg, part)
        listed = _all_files(cfg, source, name)  # listed once for the mode and the split's files
        mode = validation_mode(cfg, len(listed))
        if mode == "documents":
            packed = self._document_splits(part, listed)[0 if split == "train" else 1]
            if isinstance(packed, DataSourceError):  # held-out documents too few for a row
                raise packed
            return packed
        if split == "validation" and mode == "none":
            raise DataSourceError(f"{name}: nothing is held out for validation (data.validation_files=0)")
        fmt, text_field = _format_of(cfg, part)
        return build_packed_corpus(
            _split_files(cfg, listed, split, source, name),
            self.seq_len,
            self.tokenizer,
            fmt,
            text_field,
            strict_utf8=source != "stdlib",
            loss_on=cfg.loss_on,
        )

    def _document_splits(
        self, part: int | None, listed: list[Path]
    ) -> tuple[PackedTokens, PackedTokens | DataSourceError]:
        """One source's documents split into training and held-out rows (read once for both)."""
        if part in self._documents:
            return self._documents[part]
        cfg = self.cfg
        source, name = _source_of(cfg, part)
        files = _split_files(cfg, listed, "train", source, name)
        fmt, text_field = _format_of(cfg, part)
        train, val = build_packed_splits(
            files,
            self.seq_len,
            self.tokenizer,
            DocumentHoldout(cfg.validation_documents, cfg.validation_seed),
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
        self._documents[part] = (train, val)
        return train, val

    def check(self, vocab_size: int, evaluate: bool, global_batch_size: int | None = None) -> None:
        """Read the training (and, with ``evaluate``, the validation) rows, check that the tokenizer's ids
        fit ``vocab_size`` and, given ``global_batch_size``, that each split holds one global batch.

        Raises:
            DataSourceError: naming the file (and line or row) of bad input, both vocabulary sizes, or a
                split smaller than one global batch (in records and tokens).
        """
        cfg = self.cfg
        if not cfg.holds_out and evaluate:
            raise DataSourceError(
                "data.validation_files=0 holds out nothing for evaluation.enabled=true "
                "(or give data.validation_source, or data.validation_split='documents')"
            )
        if self.tokenizer.vocab_size > vocab_size:
            raise DataSourceError(
                f"data.tokenizer: {cfg.tokenizer or recorded_tokenizer(cfg) or 'bytes'} has {self.tokenizer.vocab_size} "
                f"token ids, more than model.vocab_size={vocab_size}"
            )
        train = self.split("train")
        val = self.split("validation") if evaluate else None
        if global_batch_size is None:
            return
        source = "data.mixture" if cfg.mixture else "data.source"
        _check_batch_fits(train, self.seq_len, global_batch_size, f"{source} (training)")
        if val is not None:
            held = f"{source} (held out for validation)"
            _check_batch_fits(
                val,
                self.seq_len,
                global_batch_size,
                "data.validation_source" if cfg.validation_source else held,
            )


def _check_batch_fits(dataset: Dataset, seq_len: int, global_batch_size: int, what: str) -> None:
    """A dataset must hold one global batch of rows; ``what`` names it (``data.source``, ...)."""
    if len(dataset) >= global_batch_size:
        return
    parts = dataset.datasets if isinstance(dataset, MixtureDataset) else [dataset]
    records = sum(p.num_documents for p in parts)
    tokens = sum(len(p.tokens) for p in parts)
    raise DataSourceError(
        f"{what}: {records:,} record(s) ({tokens:,} tokens) pack into {len(dataset)} row(s) of "
        f"batching.seq_len={seq_len}, fewer than one global batch of batching.global_batch_size="
        f"{global_batch_size} rows ({global_batch_size * seq_len + 1:,} tokens); give more data, or lower "
        "batching.global_batch_size or batching.seq_len"
    )
