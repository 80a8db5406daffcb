"""The data-format registry is the one list of formats: config validation and schema, extension
inference, the readers' dispatch and the tokenize command's choices all read it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pydantic
import pytest
from plait.loop.data import (
    DataConfig,
    DataFormatSpec,
    DataSourceError,
    ReadOptions,
    data_format,
    data_formats,
    format_of_extension,
    formats_reading,
    infer_format,
    read_documents,
    register_format,
)
from plait.loop.data.__main__ import main as data_main


def _read_tsv(path: Path, options: ReadOptions) -> Iterator[str]:
    """A user format: one document per line, the text in the column named by text_field ('0', '1', ...)."""
    for line in path.read_text().splitlines():
        yield line.split("\t")[int(options.text_field)]


USER = DataFormatSpec(
    "test_tsv", (".tsv",), read_documents=_read_tsv, fields=("text_field",), description="tab-separated"
)
if "test_tsv" not in data_formats():
    register_format(USER)


def test_builtin_formats_are_registered_records() -> None:
    assert {"text", "jsonl", "parquet", "arrow", "tokens", "chat"} <= set(data_formats())
    assert data_format("jsonl").extensions == (".jsonl", ".ndjson")
    assert format_of_extension(".PARQUET") is data_format("parquet")
    assert data_format("tokens").holds == "tokens" and data_format("chat").holds == "chats"
    assert {"jsonl", "parquet", "arrow", "test_tsv"} <= set(formats_reading("text_field"))
    assert "text" not in formats_reading("text_field")
    with pytest.raises(DataSourceError, match="unknown data format 'nope'; registered: text, jsonl"):
        data_format("nope")


def test_a_user_format_is_read_validated_and_listed(tmp_path: Path) -> None:
    path = tmp_path / "docs.tsv"
    path.write_text("a\tfirst\nb\tsecond\n")
    assert infer_format(path) == "test_tsv"
    assert list(read_documents([path], text_field="1")) == ["first", "second"]
    assert DataConfig(format="test_tsv").format == "test_tsv"
    schema = DataConfig.model_json_schema()["properties"]
    assert schema["format"]["enum"] == ["auto", *data_formats()]
    assert "'jsonl' (" in schema["format"]["description"] and "jsonl" in schema["text_field"]["description"]
    with pytest.raises(pydantic.ValidationError, match="unknown data format 'csv'"):
        DataConfig(format="csv")


def test_registration_errors() -> None:
    with pytest.raises(ValueError, match="already registered"):
        register_format(USER)
    with pytest.raises(ValueError, match="already registered"):
        register_format(DataFormatSpec("auto", read_documents=_read_tsv))
    with pytest.raises(ValueError, match=r"extensions already registered: \.jsonl \(jsonl\)"):
        register_format(DataFormatSpec("test_other", (".jsonl",), read_documents=_read_tsv))
    with pytest.raises(ValueError, match="has no read_documents"):
        DataFormatSpec("test_empty")


def test_tokenize_command_offers_the_registered_formats(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        data_main(["tokenize", "--help"])
    out = capsys.readouterr().out
    assert "test_tsv" in out and "chat" in out
    choices = out[out.index("--format") : out.index("--text-field")]
    assert "tokens" not in choices  # token files are tokenized already
