"""Streaming, atomic, optionally distributed writer of Hugging Face style safetensors checkpoints."""

from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import struct
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from .errors import KeyMismatchError, ModelStateError, SpecMismatchError, format_keys
from .reader import INDEX_NAME, SINGLE_NAME, bytes_view
from .specs import TensorSpec, dtype_to_safetensors

__all__ = ["DEFAULT_MAX_SHARD_SIZE", "CheckpointWriter", "parse_size"]

DEFAULT_MAX_SHARD_SIZE = 5 * 1024**3
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(size: int | str) -> int:
    """Bytes from an int or a string like ``"5GB"``, ``"500MiB"``."""
    if isinstance(size, int):
        if size <= 0:
            raise ValueError(f"max_shard_size must be positive, got {size}")
        return size
    m = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", size)
    if m is None or m.group(2).upper() not in _UNITS:
        raise ValueError(f"cannot parse size {size!r} (use e.g. '5GB', '500MiB' or an int)")
    return parse_size(int(float(m.group(1)) * _UNITS[m.group(2).upper()]))


_Manifest = tuple[str | None, list[tuple[str, list[str], int]]]
"""(error, [(file name, keys, data bytes)]) of one rank, gathered at commit."""


@dataclass
class _File:
    """One output file of this rank: its keys, offsets and write progress."""

    name: str
    entries: dict[str, tuple[TensorSpec, int]]  # key -> (spec, data offset)
    header: bytes
    data_size: int
    pending: set[str]
    fd: int | None = None


def _header(entries: Mapping[str, tuple[TensorSpec, int]], metadata: Mapping[str, str]) -> bytes:
    obj: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    for key, (spec, off) in entries.items():
        obj[key] = {
            "dtype": dtype_to_safetensors(spec.dtype),
            "shape": list(spec.shape),
            "data_offsets": [off, off + spec.nbytes],
        }
    raw = json.dumps(obj, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # keep the data 8-byte aligned, as safetensors does
    return struct.pack("<Q", len(raw)) + raw


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def _publish(tmp: Path, out: Path) -> None:
    """Make the finished ``tmp`` directory visible as ``out`` in one step."""
    if not out.exists():
        os.rename(tmp, out)
        return
    if not out.is_dir():
        raise ModelStateError(f"{out} exists and is not a directory")
    if _exchange(tmp, out):
        shutil.rmtree(tmp)  # now holds the previous checkpoint
        return
    old = out.with_name(f".{out.name}.old-{uuid.uuid4().hex[:8]}")
    os.rename(out, old)  # the previous checkpoint stays whole under `old` until the new one is in place
    os.rename(tmp, out)
    shutil.rmtree(old)


class CheckpointWriter:
    """Writes tensors into a sharded safetensors checkpoint as they arrive, atomically.

    The file layout (which key goes to which file, at which offset) is fixed from ``specs`` up
    front, so each tensor is written straight to its place and dropped: memory stays at one tensor,
    not one shard. Files go to a hidden temporary directory next to ``out_dir``; :meth:`commit`
    renames them to Hugging Face names (``model.safetensors`` or ``model-0000k-of-0000N.safetensors``
    plus ``model.safetensors.index.json`` with ``weight_map``, ``metadata.total_size`` and ``metadata``)
    and then publishes the directory in one rename. A crash before that leaves any previous
    checkpoint at ``out_dir`` untouched and the new one invisible.

    Distributed: every rank of ``group`` creates the writer with the specs *it* writes (possibly
    none: e.g. only one rank per pipeline stage writes); :meth:`commit` is collective, the group's
    first rank merges the index. Files of different ranks never share keys.

    Args:
        out_dir: the checkpoint directory to create or replace.
        specs: key -> spec of every tensor this rank will write, in write order.
        max_shard_size: upper bound per file (a bigger single tensor gets its own file).
        metadata: string metadata stored in every file header and the index.
        group: process group of the writing job (default: the world when torch.distributed is
            initialised). ``distributed=False`` forces a single-process writer.
        fsync: fsync files before publishing.
    """

    def __init__(
        self,
        out_dir: str | os.PathLike[str],
        specs: Mapping[str, TensorSpec],
        *,
        max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
        metadata: Mapping[str, str] | None = None,
        group: dist.ProcessGroup | None = None,
        distributed: bool | None = None,
        fsync: bool = True,
    ) -> None:
        self.out_dir = Path(out_dir).absolute()
        self.metadata = {"format": "pt", **{str(k): str(v) for k, v in (metadata or {}).items()}}
        self.group = group
        if distributed is None:
            distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
        self.distributed = distributed
        self.rank = dist.get_rank(group) if distributed else 0
        self.fsync = fsync
        token = [uuid.uuid4().hex[:12] if self.rank == 0 else None]
        if distributed:
            dist.broadcast_object_list(token, src=self._src(), group=group)
        self.tmp_dir = self.out_dir.with_name(f".{self.out_dir.name}.tmp-{token[0]}")
        self.tmp_dir.mkdir(parents=True, exist_ok=True)
        self._files = self._layout(dict(specs), parse_size(max_shard_size))
        self._key_file = {k: f for f in self._files for k in f.entries}
        self._done = False

    def _src(self) -> int:
        return dist.get_global_rank(self.group, 0) if self.group is not None else 0

    def _layout(self, specs: dict[str, TensorSpec], limit: int) -> list[_File]:
        chunks: list[dict[str, tuple[TensorSpec, int]]] = []
        size = 0
        for key, spec in specs.items():
            if not chunks or (size + spec.nbytes > limit and chunks[-1]):
                chunks.append({})
                size = 0
            chunks[-1][key] = (spec, size)
            size += spec.nbytes
        files = []
        for i, entries in enumerate(chunks):
            data = sum(s.nbytes for s, _ in entries.values())
            files.append(
                _File(
                    f"part-r{self.rank:05d}-{i:05d}.safetensors",
                    entries,
                    _header(entries, self.metadata),
                    data,
                    set(entries),
                )
            )
        return files

    @property
    def specs(self) -> dict[str, TensorSpec]:
        return {k: f.entries[k][0] for k, f in self._key_file.items()}

    def write(self, key: str, tensor: torch.Tensor) -> None:
        """Write one tensor (any order; each key once). Its shape and dtype must match its spec."""
        if self._done:
            raise ModelStateError("writer already committed or aborted")
        f = self._key_file.get(key)
        if f is None:
            raise KeyMismatchError(
                f"{self.out_dir}: unexpected key {key!r}: not among the writer's specs", unexpected=[key]
            )
        if key not in f.pending:
            raise ModelStateError(f"{self.out_dir}: key {key!r} written twice")
        spec, off = f.entries[key]
        got = TensorSpec.of(tensor)
        if got != spec:
            raise SpecMismatchError(f"{self.out_dir}: tensor {key!r} is {got}, the writer expects {spec}")
        if isinstance(tensor, torch.distributed.tensor.DTensor):
            raise ModelStateError(f"tensor {key!r} is a DTensor: gather it (full_tensor()) before writing")
        if f.fd is None:
            f.fd = os.open(self.tmp_dir / f.name, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            os.write(f.fd, f.header)
        view = bytes_view(tensor.detach().to("cpu").contiguous())
        pos = len(f.header) + off
        while len(view):  # pwrite may write less than asked for large buffers
            n = os.pwrite(f.fd, view, pos)
            view, pos = view[n:], pos + n
        f.pending.discard(key)
        if not f.pending:
            self._close(f)

    def _close(self, f: _File) -> None:
        if f.fd is None:
            return
        if self.fsync:
            os.fsync(f.fd)
        os.close(f.fd)
        f.fd = None

    def commit(self) -> Path:
        """Finish: check every key was written, merge the index, publish atomically (collective).

        Returns:
            The published checkpoint directory.

        Raises:
            KeyMismatchError: keys declared in ``specs`` were never written (listed).
        """
        missing = [k for f in self._files for k in f.pending]
        error = None
        if missing:
            error = f"rank {self.rank}: keys never written to {self.out_dir}: {format_keys(missing)}"
        for f in self._files:
            self._close(f)
        manifest = (
            error,
            [(f.name, list(f.entries), sum(s.nbytes for s, _ in f.entries.values())) for f in self._files],
        )
        if self.distributed:
            gathered: list[_Manifest] = [(None, [])] * dist.get_world_size(self.group)
            dist.all_gather_object(gathered, manifest, group=self.group)
        else:
            gathered = [manifest]
        errors = [e for e, _ in gathered if e]
        status: list[str | None] = [None]
        if errors:
            self.abort()
            raise KeyMismatchError("\n".join(errors), missing=missing)
        if self.rank == 0:
            try:
                self._finish([m for _, m in gathered])
            except Exception as e:
                status[0] = f"{type(e).__name__}: {e}"
        if self.distributed:
            dist.broadcast_object_list(status, src=self._src(), group=self.group)
        self._done = True
        if status[0] is not None:
            raise ModelStateError(f"publishing {self.out_dir} failed on rank 0: {status[0]}")
        return self.out_dir

    def _finish(self, manifests: list[list[tuple[str, list[str], int]]]) -> None:
        files = [f for m in manifests for f in m]
        seen: dict[str, str] = {}
        clash = set()
        for name, keys, _ in files:
            for k in keys:
                if k in seen:
                    clash.add(k)
                seen[k] = name
        if clash:
            raise KeyMismatchError(
                f"keys written by more than one rank: {format_keys(clash)}", unexpected=clash
            )
        if not files:
            (self.tmp_dir / SINGLE_NAME).write_bytes(_header({}, self.metadata))
        elif len(files) == 1:
            os.rename(self.tmp_dir / files[0][0], self.tmp_dir / SINGLE_NAME)
        else:
            n = len(files)
            weight_map: dict[str, str] = {}
            for i, (name, keys, _) in enumerate(files):
                final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
                os.rename(self.tmp_dir / name, self.tmp_dir / final)
                weight_map.update(dict.fromkeys(keys, final))
            index = {
                "metadata": {**self.metadata, "total_size": sum(size for _, _, size in files)},
                "weight_map": dict(sorted(weight_map.items())),
            }
            (self.tmp_dir / INDEX_NAME).write_text(json.dumps(index, indent=2))
        _publish(self.tmp_dir, self.out_dir)

    def abort(self) -> None:
        """Discard everything this rank wrote (the group's first rank removes the temporary dir)."""
        for f in self._files:
            if f.fd is not None:
                os.close(f.fd)
                f.fd = None
        self._done = True
        if self.rank == 0 or not self.distributed:
            shutil.rmtree(self.tmp_dir, ignore_errors=True)
        else:
            for f in self._files:
                (self.tmp_dir / f.name).unlink(missing_ok=True)

    def __enter__(self) -> CheckpointWriter:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is None:
            self.commit()
        elif not self._done:
            self.abort()
