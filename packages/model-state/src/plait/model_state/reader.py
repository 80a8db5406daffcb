"""Lazy reader of Hugging Face style safetensors checkpoints (single file or sharded index)."""

from __future__ import annotations

import ctypes
import itertools
import json
import math
import os
import struct
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

import torch

from .errors import CheckpointFormatError, format_keys
from .specs import Region, TensorSpec, dtype_from_safetensors, region_shape

__all__ = ["INDEX_NAME", "SINGLE_NAME", "CheckpointReader"]

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
_MAX_HEADER = 100 * 2**20  # the safetensors limit
_CHUNK = 8 * 2**20  # parallel read granularity
_MIN_RUN_BYTES = 1 << 16  # box reads: below this per contiguous run, read whole rows and slice


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
        for key, name in weight_map.items():
            _check_index_entry(path, key, name)
        names = sorted(set(weight_map.values()))
        absent = [n for n in names if not (path.parent / n).is_file()]
        if absent:
            raise CheckpointFormatError(f"{path}: index names files that do not exist: {format_keys(absent)}")
        return [path.parent / n for n in names], dict(weight_map), dict(index.get("metadata") or {})
    return [path], None, {}


def _check_index_entry(index: Path, key: str, name: object) -> None:
    """Refuse an index entry whose file lies outside the checkpoint directory.

    The file must be a relative path without ``..`` below the index's directory, and must resolve
    (symlinks followed) inside that directory; the one exception is the Hugging Face hub cache,
    where ``snapshots/<revision>/<file>`` links to ``../../blobs/<hash>``.
    """
    root = index.parent
    where = f"{index}: weight_map entry {key!r} -> {name!r}"
    if not isinstance(name, str) or not name:
        raise CheckpointFormatError(f"{where}: the file name must be a non-empty string")
    rel = PurePosixPath(name)
    if rel.is_absolute() or PureWindowsPath(name).is_absolute() or ".." in rel.parts or "\\" in name:
        raise CheckpointFormatError(
            f"{where}: names a file outside the checkpoint directory {root} (only relative names below it are allowed)"
        )
    target = (root / rel).resolve()
    allowed = [root.resolve()]
    if root.parent.name == "snapshots":  # Hugging Face hub cache layout
        allowed.append((root.parent.parent / "blobs").resolve())
    if not any(target.is_relative_to(a) for a in allowed):
        raise CheckpointFormatError(
            f"{where}: resolves (through a symlink) to {target}, outside the checkpoint directory {root}"
        )


@dataclass(frozen=True)
class _Entry:
    fd: int
    offset: int  # absolute byte offset of the tensor's data in its file
    spec: TensorSpec


def _parse_header(f: Path, fd: int) -> tuple[dict[str, tuple[TensorSpec, int]], dict[str, str]]:
    """Validate a safetensors header: tensor specs with absolute data offsets, and metadata."""
    size = os.fstat(fd).st_size
    if size < 8:
        raise CheckpointFormatError(f"{f}: truncated safetensors file ({size} bytes, no header)")
    (n,) = struct.unpack("<Q", os.pread(fd, 8, 0))
    if n > _MAX_HEADER or 8 + n > size:
        raise CheckpointFormatError(
            f"{f}: corrupted safetensors header: header length {n} does not fit the file ({size} bytes)"
        )
    try:
        header = json.loads(os.pread(fd, n, 8))
        if not isinstance(header, dict):
            raise TypeError("header is not a JSON object")
    except (ValueError, TypeError) as e:
        raise CheckpointFormatError(f"{f}: corrupted safetensors header: {e}") from None
    metadata = header.pop("__metadata__", None) or {}
    base = 8 + n
    out: dict[str, tuple[TensorSpec, int]] = {}
    end_max = 0
    spans: list[tuple[int, int, str]] = []
    for key, info in header.items():
        try:
            shape, offsets = info["shape"], info["data_offsets"]
            if not all(_is_count(x) for x in (*shape, *offsets)) or len(offsets) != 2:
                raise ValueError(
                    f"shape {shape} and data_offsets {offsets} must be non-negative integers (2 offsets)"
                )
            spec = TensorSpec(tuple(shape), dtype_from_safetensors(info["dtype"]))
            begin, end = offsets
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointFormatError(f"{f}: corrupted safetensors header entry for {key!r}: {e}") from None
        if end - begin != spec.nbytes:
            raise CheckpointFormatError(
                f"{f}: tensor {key!r} {spec} has data_offsets {[begin, end]} of the wrong length"
            )
        end_max = max(end_max, end)
        out[key] = (spec, base + begin)
        if end > begin:
            spans.append((begin, end, key))
    spans.sort()
    for (_, prev_end, prev), (begin, end, key) in itertools.pairwise(spans):
        if begin < prev_end:
            raise CheckpointFormatError(
                f"{f}: tensor {key!r} data_offsets {[begin, end]} overlap those of {prev!r} (ending at {prev_end})"
            )
    if base + end_max > size:
        raise CheckpointFormatError(
            f"{f}: truncated safetensors file: data ends at byte {base + end_max}, file has {size}"
        )
    return out, {str(k): str(v) for k, v in metadata.items()}


def _is_count(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def bytes_view(t: torch.Tensor) -> memoryview:
    """Writable byte view of a contiguous CPU tensor's memory (no copy, no numpy).

    The view keeps ``t`` alive, so a temporary tensor may be passed.
    """
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(
            f"bytes_view needs a contiguous CPU tensor, got {t.device} contiguous={t.is_contiguous()}"
        )
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(bytearray())
    buf = (ctypes.c_char * n).from_address(t.data_ptr())
    buf._tensor = t  # type: ignore[attr-defined]  # noqa: SLF001  the memory's owner lives as long as the view
    return memoryview(buf).cast("B")


def _pread_parallel(
    pool: ThreadPoolExecutor | None, fd: int, buf: memoryview, offset: int, path: Path
) -> None:
    """Large reads in chunks on several threads (preadv releases the GIL; the copies run in parallel)."""
    n = len(buf)
    if pool is None or n < 2 * _CHUNK:
        _pread_into(fd, buf, offset, path)
        return
    futures = [
        pool.submit(_pread_into, fd, buf[a : a + _CHUNK], offset + a, path) for a in range(0, n, _CHUNK)
    ]
    for f in futures:
        f.result()


def _pread_into(fd: int, buf: memoryview, offset: int, path: Path) -> None:
    while len(buf):
        n = os.preadv(fd, [buf], offset)
        if n <= 0:
            raise CheckpointFormatError(f"{path}: unexpected end of file at byte {offset}")
        buf, offset = buf[n:], offset + n


class CheckpointReader:
    """Streams tensors out of a safetensors checkpoint without loading it whole.

    ``path`` may be a directory (with ``model.safetensors.index.json``, ``model.safetensors`` or
    ``*.safetensors`` files), an index file or one ``.safetensors`` file. Every file is opened once,
    and its header is parsed and validated when the reader is created. :meth:`read` then reads just
    the requested tensor, or just a box of it, with positioned reads straight into the destination
    buffer: no memory map, so process memory is what the caller holds (reading through a memory
    map keeps every page read resident until the file is closed). Use as a context manager or call
    :meth:`close`. ``threads`` (default: up to 8 cores) read large tensors in parallel chunks.

    Raises:
        FileNotFoundError: no checkpoint at ``path``.
        CheckpointFormatError: corrupted header, truncated file, broken index (the file is named).
    """

    def __init__(self, path: str | os.PathLike[str], *, threads: int | None = None) -> None:
        self.path = Path(path)
        if threads is None:
            threads = min(
                8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
            )
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="plait-read") if threads > 1 else None
        files, weight_map, self.index_metadata = _resolve(self.path)
        self.files = files
        self._fds: dict[Path, int] = {}
        self._entries: dict[str, _Entry] = {}
        self._specs: dict[str, TensorSpec] = {}
        self._where: dict[str, Path] = {}
        self._file_meta: dict[str, str] = {}
        self.bytes_read = 0
        try:
            for f in files:
                self._open(f, weight_map)
            if weight_map is not None:
                absent = [k for k in weight_map if k not in self._entries]
                if absent:
                    raise CheckpointFormatError(
                        f"{self.path}: keys in the index but not in their files: {format_keys(absent)}"
                    )
        except BaseException:
            self.close()
            raise

    def _open(self, f: Path, weight_map: dict[str, str] | None) -> None:
        fd = os.open(f, os.O_RDONLY)
        self._fds[f] = fd
        entries, meta = _parse_header(f, fd)
        self._file_meta.update(meta)
        for key, (spec, offset) in entries.items():
            if weight_map is not None and weight_map.get(key) != f.name:
                continue  # the index is authoritative, as in Hugging Face
            if key in self._where:
                raise CheckpointFormatError(
                    f"{self.path}: key {key!r} is in both {self._where[key].name} and {f.name}"
                )
            self._entries[key] = _Entry(fd, offset, spec)
            self._specs[key] = spec
            self._where[key] = f
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)

    @property
    def specs(self) -> Mapping[str, TensorSpec]:
        """Shape and dtype of every tensor, from the headers (nothing read)."""
        return self._specs

    def keys(self) -> Iterator[str]:
        return iter(self._entries)

    def file_of(self, key: str) -> Path:
        """The file holding ``key``."""
        return self._where[key]

    def metadata(self) -> dict[str, str]:
        """The ``__metadata__`` of the files merged with the index's ``metadata``."""
        return {**self._file_meta, **{k: str(v) for k, v in self.index_metadata.items()}}

    def read(self, key: str, region: Region | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """Read tensor ``key``, or only ``region`` of it (reading just those bytes where possible).

        Args:
            key: the tensor.
            region: a box, one ``(start, stop)`` per dim; ``None`` for the whole tensor.
            out: optional contiguous CPU tensor of the right shape and dtype to read into
                (e.g. a parameter or a pinned buffer); saves an allocation and a copy.
        """
        try:
            entry = self._entries[key]
        except KeyError:
            raise KeyError(f"{self.path}: no tensor {key!r}") from None
        spec = entry.spec
        shape = spec.shape if region is None else region_shape(region)
        if len(shape) != len(spec.shape) or any(
            b > s or a < 0 for (a, b), s in zip(region or (), spec.shape)
        ):
            raise ValueError(f"region {region} does not fit tensor {key!r} {spec}")
        if out is None:
            out = torch.empty(shape, dtype=spec.dtype)
        elif (
            tuple(out.shape) != tuple(shape)
            or out.dtype != spec.dtype
            or not out.is_contiguous()
            or out.device.type != "cpu"
        ):
            raise ValueError(
                f"out for {key!r} must be a contiguous CPU {spec.dtype} tensor of shape {list(shape)}"
            )
        if out.numel() == 0:
            return out
        buf = bytes_view(out)
        item = spec.dtype.itemsize
        if region is None or shape == spec.shape:
            _pread_parallel(self._pool, entry.fd, buf, entry.offset, self._where[key])
            self.bytes_read += len(buf)
        else:
            self.bytes_read += self._read_box(entry, region, out, buf, item)
        return out

    def _read_box(self, entry: _Entry, region: Region, out: torch.Tensor, buf: memoryview, item: int) -> int:
        shape = entry.spec.shape
        # The last dim that is cut: dims after it are whole, so each index of the dims before it
        # is one contiguous run of bytes in the file.
        k = max(i for i, (r, s) in enumerate(zip(region, shape)) if r != (0, s))
        inner = math.prod(shape[k + 1 :])
        run = (region[k][1] - region[k][0]) * inner * item
        n_runs = math.prod(b - a for a, b in region[:k])
        path = self.path
        if run >= _MIN_RUN_BYTES or k == 0:
            strides = [math.prod(shape[i + 1 :]) for i in range(len(shape))]
            pos = 0
            for idx in itertools.product(*(range(a, b) for a, b in region[:k])):
                elem = sum(i * s for i, s in zip(idx, strides)) + region[k][0] * strides[k]
                _pread_into(entry.fd, buf[pos : pos + run], entry.offset + elem * item, path)
                pos += run
            return n_runs * run
        # Many small runs: read the rows of dim 0 that the box spans, then cut in memory.
        a0, b0 = region[0]
        rows = torch.empty((b0 - a0, *shape[1:]), dtype=entry.spec.dtype)
        row_bytes = math.prod(shape[1:]) * item
        _pread_into(entry.fd, bytes_view(rows), entry.offset + a0 * row_bytes, path)
        out.copy_(rows[(slice(None), *(slice(a, b) for a, b in region[1:]))])
        return rows.numel() * item

    def close(self) -> None:
        """Close every file."""
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"CheckpointReader({str(self.path)!r}, {len(self._entries)} tensors in {len(self.files)} files)"
        )
