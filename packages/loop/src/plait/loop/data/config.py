"""``[data]``: where a job's text comes from, how it is read and tokenised, and what is held out."""

from __future__ import annotations

from typing import Literal

from plait.loop.data.formats import AUTO, data_format, data_formats, formats_reading
from plait.loop.data.sources import DataFormat, LossOn
from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["DataConfig", "MixtureSource"]


def _format_help() -> str:
    """``data.format``'s description, from the formats registered (the built-ins, when this is imported)."""
    described = ", ".join(f"'{name}' ({data_format(name).description})" for name in data_formats())
    return f"'{AUTO}' (from each file's extension), or one of the registered formats: {described}"


def _text_field_help() -> str:
    return f"The record field / table column of the text (formats {', '.join(formats_reading('text_field'))})"


class MixtureSource(BaseModel):
    """One ``[[data.mixture]]`` table: a source and its weight in the mixture."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    source: str = Field(description="'stdlib', or a file, a directory or a glob")
    format: DataFormat = Field(default="auto", description="As data.format")
    weight: float = Field(gt=0, allow_inf_nan=False, description="Relative share of the rows (> 0)")
    text_field: str | None = Field(default=None, description="As data.text_field (None: data.text_field)")


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
        default="stdlib",
        description="'stdlib' (this Python's own library sources), or a file, a directory or a glob",
    )
    format: DataFormat = Field(default="auto", description=_format_help())
    text_field: str = Field(default="text", description=_text_field_help())
    loss_on: LossOn = Field(
        default="assistant",
        description="format='chat': train on the assistant tokens only ('assistant') or on every token ('all')",
    )
    pattern: str | None = Field(
        default=None, description="The files of a directory source ('*.py' for stdlib, else every file)"
    )
    tokenizer: str | None = Field(
        default=None,
        description="'bytes' or a directory with tokenizer.json; unset: the --init-from checkpoint's "
        "tokenizer if it has one, else the tokenizer a tokenized source's meta.json records, else bytes",
    )
    max_files: int | None = Field(
        default=400, ge=1, description="Cap on training files (sorted by path), None for all"
    )
    validation_split: Literal["auto", "files", "documents"] = Field(
        default="auto",
        description="How validation is held out of the source: 'auto' (files when the source has more than "
        "validation_files files, else documents), 'files' or 'documents'",
    )
    validation_files: int = Field(
        default=8,
        ge=0,
        description="The corpus's last files (sorted by path), held out for evaluation (0: none)",
    )
    validation_documents: int | float = Field(
        default=0.05,
        gt=0,
        description="Documents held out when documents are: a number (an int >= 1) or a fraction (a float "
        "in (0, 1), at least one document)",
    )
    validation_seed: int = Field(default=0, description="Seed of the draw of the held-out documents")
    validation_source: str | None = Field(
        default=None,
        description="A separate validation corpus (file, directory or glob, read with data.format and "
        "data.text_field); nothing is then held out of the training source",
    )
    mixture: tuple[MixtureSource, ...] = Field(
        default=(),
        description="[[data.mixture]] tables (source, format, weight, text_field): rows drawn from several "
        "sources in proportion to their weights, instead of data.source",
    )
    mixture_seed: int = Field(default=0, description="Seed of the mixture's assignment of rows to sources")

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
