"""Readers: text and JSONL files, pre-tokenised numpy token files, Hugging Face ``datasets`` (optional)."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "ConcatenatedTokens",
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


class ConcatenatedTokens:
    """Flat token arrays (e.g. the ``np.memmap`` of several token files) read as one, without copying.

    Keeps each array and the offsets where each starts in the concatenation; ``tokens[a:b]`` (unit
    step) reads only the arrays the range covers and ``tokens[i]`` one value, which is all
    :class:`~plait.loop.data.PackedTokens` reads. ``np.asarray(tokens)`` concatenates them all in memory.

    Args:
        arrays: 1-d arrays of one dtype, in order.

    Raises:
        ValueError: no arrays, arrays that are not 1-d or of different dtypes.
    """

    def __init__(self, arrays: Sequence[np.ndarray]) -> None:
        if not arrays:
            raise ValueError("ConcatenatedTokens: no arrays")
        dtypes = {np.dtype(a.dtype) for a in arrays}
        if len(dtypes) > 1 or any(a.ndim != 1 for a in arrays):
            raise ValueError(
                f"ConcatenatedTokens: 1-d arrays of one dtype, got {[f'{a.dtype}{a.shape}' for a in arrays]}"
            )
        self.arrays = list(arrays)
        self.dtype = dtypes.pop()
        self.starts = np.concatenate([[0], np.cumsum([len(a) for a in arrays])]).astype(np.int64)

    def __len__(self) -> int:
        return int(self.starts[-1])

    @property
    def shape(self) -> tuple[int]:
        return (len(self),)

    def __getitem__(self, key: int | slice) -> Any:
        if isinstance(key, slice):
            start, stop, step = key.indices(len(self))
            if step != 1:
                raise TypeError(f"ConcatenatedTokens: only unit-step slices, got step {step}")
            parts = []
            k = int(np.searchsorted(self.starts, start, "right")) - 1
            while start < stop:
                lo = start - int(self.starts[k])
                hi = min(stop, int(self.starts[k + 1])) - int(self.starts[k])
                parts.append(self.arrays[k][lo:hi])
                start, k = int(self.starts[k + 1]), k + 1
            if not parts:
                return np.empty(0, self.dtype)
            return parts[0] if len(parts) == 1 else np.concatenate(parts)
        i = int(key) + (len(self) if int(key) < 0 else 0)
        if not 0 <= i < len(self):
            raise IndexError(f"index {key} is out of bounds for {len(self)} tokens")
        k = int(np.searchsorted(self.starts, i, "right")) - 1
        return self.arrays[k][i - int(self.starts[k])]

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        out = np.concatenate(self.arrays)
        return out if dtype is None else out.astype(dtype)


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
