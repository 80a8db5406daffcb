"""Readers: JSONL text, pre-tokenised numpy token files, Hugging Face ``datasets`` (optional)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["read_hf_texts", "read_jsonl_texts", "read_token_file", "write_token_file"]


def read_jsonl_texts(path: str | Path, field: str = "text") -> Iterator[str]:
    """Yield ``record[field]`` of each non-empty line of a JSON-lines file.

    Raises:
        ValueError: naming the file and line for bad JSON or a missing/non-string field.
    """
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON: {e}") from None
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
