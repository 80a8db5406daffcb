"""Lazy reader of Hugging Face style safetensors checkpoints (single file or sharded index)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from .errors import CheckpointFormatError, format_keys
from .specs import Region, TensorSpec, dtype_from_safetensors, region_shape

__all__ = ["INDEX_NAME", "SINGLE_NAME", "CheckpointReader"]

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


def _resolve(path: Path) -> tuple[list[Path], dict[str, str] | None, dict[str, Any]]:
    """Files of a checkpoint, the index's weight map (if any) and the index metadata."""
    if path.is_dir():
        if (path / INDEX_NAME).is_file():
            return _resolve(path / INDEX_NAME)
        if (path / SINGLE_NAME).is_file():
            return [path / SINGLE_NAME], None, {}
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{path}: no {INDEX_NAME}, {SINGLE_NAME} or *.safetensors file")
        return files, None, {}
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    if path.name.endswith(".json"):
        try:
            index = json.loads(path.read_text())
            weight_map = index["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointFormatError(
                f"{path}: not a valid safetensors index ({type(e).__name__}: {e})"
            ) from None
        names = sorted(set(weight_map.values()))
        absent = [n for n in names if not (path.parent / n).is_file()]
        if absent:
            raise CheckpointFormatError(f"{path}: index names files that do not exist: {format_keys(absent)}")
        return [path.parent / n for n in names], dict(weight_map), dict(index.get("metadata") or {})
    return [path], None, {}


class CheckpointReader:
    """Streams tensors out of a safetensors checkpoint without loading it whole.

    ``path`` may be a directory (with ``model.safetensors.index.json``, ``model.safetensors`` or
    ``*.safetensors`` files), an index file or one ``.safetensors`` file. Every file is opened once
    (``safetensors.safe_open``; headers only) when the reader is created; :meth:`read` then copies
    out just the requested tensor, or just a box of it (``get_slice``), so memory stays at what the
    caller holds. Use as a context manager or call :meth:`close`.

    Raises:
        FileNotFoundError: no checkpoint at ``path``.
        CheckpointFormatError: corrupted header, truncated file, broken index (the file is named).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        files, weight_map, self.index_metadata = _resolve(self.path)
        self.files = files
        self._handles: dict[Path, Any] = {}
        self._where: dict[str, Path] = {}
        self._specs: dict[str, TensorSpec] = {}
        self.bytes_read = 0
        try:
            for f in files:
                self._open(f, weight_map)
        except BaseException:
            self.close()
            raise
        if weight_map is not None:
            absent = [k for k in weight_map if k not in self._specs]
            if absent:
                raise CheckpointFormatError(
                    f"{self.path}: keys in the index but not in their files: {format_keys(absent)}"
                )

    def _open(self, f: Path, weight_map: dict[str, str] | None) -> None:
        size = f.stat().st_size
        try:
            handle = safe_open(str(f), framework="pt", device="cpu")
        except Exception as e:  # safetensors raises its own SafetensorError / OSError
            raise CheckpointFormatError(f"{f}: unreadable safetensors file ({size} bytes): {e}") from None
        self._handles[f] = handle
        for key in handle.keys():  # noqa: SIM118 (safe_open handles are not iterable)
            if weight_map is not None and weight_map.get(key) != f.name:
                continue  # the index is authoritative, as in Hugging Face
            if key in self._where:
                raise CheckpointFormatError(
                    f"{self.path}: key {key!r} is in both {self._where[key].name} and {f.name}"
                )
            sl = handle.get_slice(key)
            try:
                dtype = dtype_from_safetensors(sl.get_dtype())
            except ValueError as e:
                raise CheckpointFormatError(f"{f}: tensor {key!r}: {e}") from None
            self._specs[key] = TensorSpec(tuple(int(s) for s in sl.get_shape()), dtype)
            self._where[key] = f

    @property
    def specs(self) -> Mapping[str, TensorSpec]:
        """Shape and dtype of every tensor, from the headers (nothing read)."""
        return self._specs

    def keys(self) -> Iterator[str]:
        return iter(self._specs)

    def file_of(self, key: str) -> Path:
        """The file holding ``key``."""
        return self._where[key]

    def metadata(self) -> dict[str, str]:
        """The ``__metadata__`` of the files merged with the index's ``metadata``."""
        out: dict[str, str] = {}
        for h in self._handles.values():
            out.update(h.metadata() or {})
        out.update({k: str(v) for k, v in self.index_metadata.items()})
        return out

    def read(self, key: str, region: Region | None = None) -> torch.Tensor:
        """Read tensor ``key`` (or only ``region`` of it, reading just those bytes)."""
        try:
            f = self._where[key]
        except KeyError:
            raise KeyError(f"{self.path}: no tensor {key!r}") from None
        spec = self._specs[key]
        handle = self._handles[f]
        try:
            if region is None or not spec.shape:
                t = handle.get_tensor(key)
            else:
                shape = region_shape(region)
                if 0 in shape:
                    return torch.empty(shape, dtype=spec.dtype)
                t = handle.get_slice(key)[tuple(slice(a, b) for a, b in region)]
        except Exception as e:
            raise CheckpointFormatError(f"{f}: cannot read tensor {key!r} {spec}: {e}") from None
        self.bytes_read += t.numel() * t.element_size()
        return t

    def close(self) -> None:
        """Close every file."""
        for h in self._handles.values():
            close = getattr(h, "__exit__", None)
            if close is not None:
                close(None, None, None)
        self._handles.clear()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"CheckpointReader({str(self.path)!r}, {len(self._specs)} tensors in {len(self.files)} files)"
