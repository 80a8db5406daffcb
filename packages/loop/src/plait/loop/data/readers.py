"""Readers: text and JSONL files, pre-tokenised numpy token files, Hugging Face ``datasets`` (optional)."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "read_hf_texts",
    "read_jsonl_records",
    "read_jsonl_texts",
    "read_text_file",
    "read_token_file",
    "write_token_file",
]

log = logging.getLogger(__name__)
_ESCAPED_BYTE = re.compile("[\udc80-\udcff]")  # what ``surrogateescape`` makes of an invalid byte


def read_text_file(path: str | Path) -> str:
    """The text of a UTF-8 file; bytes that are not UTF-8 become U+FFFD, with one warning per call
    naming the file and the number of replaced bytes."""
    data = Path(path).read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        bad = len(_ESCAPED_BYTE.findall(data.decode("utf-8", errors="surrogateescape")))
        log.warning("%s: %d byte(s) that are not UTF-8 were replaced by U+FFFD", path, bad)
        return data.decode("utf-8", errors="replace")


def read_jsonl_records(path: str | Path) -> Iterator[tuple[int, Any]]:
    """Yield ``(line number, parsed JSON)`` of each non-empty line of a JSON-lines file (UTF-8).

    Raises:
        ValueError: naming the file and line for bytes that are not UTF-8 or a line that is not JSON.
    """
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(
                    f"{path}:{lineno}: not valid UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1})"
                ) from None
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON: {e}") from None


def read_jsonl_texts(path: str | Path, field: str = "text") -> Iterator[str]:
    """Yield ``record[field]`` of each non-empty line of a JSON-lines file (UTF-8).

    Raises:
        ValueError: naming the file and line for bytes that are not UTF-8, bad JSON or a
            missing/non-string field.
    """
    for lineno, record in read_jsonl_records(path):
        value = record.get(field) if isinstance(record, dict) else None
        if not isinstance(value, str):
            raise ValueError(f"{path}:{lineno}: field {field!r} missing or not a string")
        yield value


def write_token_file(path: str | Path, tokens: Any, dtype: Any = np.uint16) -> None:
    """Write a flat token array as raw ``dtype`` values (the format :func:`read_token_file` maps)."""
    arr = np.asarray(tokens)
    if arr.size and (arr.min() < np.iinfo(dtype).min or arr.max() > np.iinfo(dtype).max):
        raise ValueError(f"token ids [{arr.min()}, {arr.max()}] do not fit {np.dtype(dtype).name}")
    arr.astype(dtype).tofile(path)


def read_token_file(path: str | Path, dtype: Any = np.uint16) -> np.memmap:
    """Memory-map a raw token file (``uint16`` for vocabularies < 65536, else ``uint32``).

    Wrap it in :class:`~plait.loop.data.PackedTokens` to read fixed-length samples lazily.
    """
    size = Path(path).stat().st_size
    itemsize = np.dtype(dtype).itemsize
    if size % itemsize:
        raise ValueError(f"{path}: {size} bytes is not a whole number of {np.dtype(dtype).name} tokens")
    return np.memmap(path, dtype=dtype, mode="r")


def read_hf_texts(path: str, split: str = "train", field: str = "text", **kwargs: Any) -> Iterator[str]:
    """Yield ``field`` of each record of a Hugging Face dataset (``datasets.load_dataset``).

    Raises:
        ImportError: without the ``datasets`` package (``pip install 'plait-loop[datasets]'``).
    """
    try:
        import datasets
    except ImportError as e:
        raise ImportError(
            "read_hf_texts needs Hugging Face datasets: pip install 'plait-loop[datasets]'"
        ) from e
    ds = datasets.load_dataset(path, split=split, **kwargs)
    if field not in ds.column_names:
        raise ValueError(f"dataset {path!r} has no column {field!r} (columns: {ds.column_names})")
    for record in ds:
        yield record[field]
