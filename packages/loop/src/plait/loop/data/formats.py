"""Data formats: one record per format (its name, file extensions, reader and the config fields it
reads) in one registry, :func:`register_format`.

The registry is the one list of formats: ``data.format``'s validation and JSON schema, the extension
inference of ``format="auto"``, the readers' dispatch, the ``tokenize`` command's choices and the
messages that list formats all read it. The built-in formats (``text``, ``jsonl``, ``parquet``,
``arrow``, ``tokens``, ``chat``) are registered by :mod:`plait.loop.data.sources` with this same call.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import GetCoreSchemaHandler, GetJsonSchemaHandler
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import core_schema

__all__ = [
    "AUTO",
    "DataFormat",
    "DataFormatSpec",
    "DataSourceError",
    "Holds",
    "ReadOptions",
    "data_format",
    "data_formats",
    "format_of_extension",
    "formats_reading",
    "register_format",
]

AUTO = "auto"
"""The ``data.format`` value that picks each file's format from its extension."""

Holds = Literal["documents", "tokens", "chats"]


class DataSourceError(ValueError):
    """Bad corpus input; the message (one line) names the file and, where it applies, the line or row."""


@dataclass(frozen=True)
class ReadOptions:
    """What a document reader is told besides the path.

    Attributes:
        text_field: the record field / table column of the text (``data.text_field``).
        strict_utf8: refuse bytes that are not UTF-8 (else, where a format allows, replace them).
    """

    text_field: str = "text"
    strict_utf8: bool = True


@dataclass(frozen=True)
class DataFormatSpec:
    """One data format.

    Attributes:
        name: the value of ``data.format`` (and ``--format``) that selects it.
        extensions: file suffixes (lower case, with the dot) that ``format="auto"`` reads with it.
        holds: what its files hold: ``"documents"`` (texts, one per file, line or row), ``"tokens"``
            (raw token ids, memory-mapped) or ``"chats"`` (conversations, rendered with the chat template).
        read_documents: ``(path, options) -> texts`` of a ``"documents"`` format (:class:`ReadOptions`;
            raise :class:`DataSourceError` naming the file and line or row on bad input).
        read_column: ``(path, column) -> values``, row by row, of a table format (parquet, arrow):
            the ``chat`` format reads the ``messages`` column of such files with it.
        fields: the ``data`` config fields it reads besides ``source`` (e.g. ``("text_field",)``).
        description: a few words for the config's documentation and the command's help.
    """

    name: str
    extensions: tuple[str, ...] = ()
    holds: Holds = "documents"
    read_documents: Callable[[Path, ReadOptions], Iterator[str]] | None = None
    read_column: Callable[[Path, str], Iterator[Any]] | None = None
    fields: tuple[str, ...] = ()
    description: str = ""

    def __post_init__(self) -> None:
        if self.holds == "documents" and self.read_documents is None:
            raise ValueError(f"data format {self.name!r} holds documents but has no read_documents")
        if any(e != e.lower() or not e.startswith(".") for e in self.extensions):
            raise ValueError(
                f"data format {self.name!r}: extensions are lower case with a dot, got {self.extensions}"
            )


_FORMATS: dict[str, DataFormatSpec] = {}


def register_format(spec: DataFormatSpec) -> None:
    """Register a data format: ``data.format = spec.name`` selects it, and ``format="auto"`` reads the
    files with its extensions with it.

    Raises:
        ValueError: the name (or ``"auto"``) or one of the extensions is registered already.
    """
    if spec.name == AUTO or spec.name in _FORMATS:
        raise ValueError(f"data format {spec.name!r} is already registered")
    taken = {e: f.name for f in _FORMATS.values() for e in f.extensions}
    if clash := [f"{e} ({taken[e]})" for e in spec.extensions if e in taken]:
        raise ValueError(f"data format {spec.name!r}: extensions already registered: {', '.join(clash)}")
    _FORMATS[spec.name] = spec


def data_formats() -> tuple[str, ...]:
    """The names of the registered formats, in registration order (``"auto"`` is not one)."""
    return tuple(_FORMATS)


def data_format(name: str) -> DataFormatSpec:
    """The format registered as ``name``.

    Raises:
        DataSourceError: an unknown name, naming the registered ones.
    """
    spec = _FORMATS.get(name)
    if spec is None:
        raise DataSourceError(f"unknown data format {name!r}; registered: {', '.join(data_formats())}")
    return spec


def format_of_extension(suffix: str) -> DataFormatSpec | None:
    """The format that reads files ending in ``suffix`` (any case), or None."""
    suffix = suffix.lower()
    return next((f for f in _FORMATS.values() if suffix in f.extensions), None)


def formats_reading(field: str) -> tuple[str, ...]:
    """The names of the formats that read the config field ``field`` (e.g. ``"text_field"``)."""
    return tuple(f.name for f in _FORMATS.values() if field in f.fields)


def _check_format(value: str) -> str:
    if value != AUTO:
        try:
            data_format(value)
        except DataSourceError as e:
            raise ValueError(f"{e} (or {AUTO!r})") from None
    return value


class _RegisteredFormat:
    """Pydantic metadata of ``data.format``: ``"auto"`` or a registered format, its JSON schema's enum
    read from the registry when the schema is made."""

    def __get_pydantic_core_schema__(
        self, source: Any, handler: GetCoreSchemaHandler
    ) -> core_schema.CoreSchema:
        return core_schema.no_info_after_validator_function(_check_format, handler(source))

    def __get_pydantic_json_schema__(
        self, schema: core_schema.CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        return {**handler(schema), "enum": [AUTO, *data_formats()]}


DataFormat = Annotated[str, _RegisteredFormat()]
"""The type of ``data.format`` fields: ``"auto"`` or the name of a registered format."""
