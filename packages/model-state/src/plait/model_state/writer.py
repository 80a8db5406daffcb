"""Streaming, atomic, optionally distributed writer of Hugging Face style safetensors checkpoints."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import logging
import os
import re
import shutil
import stat
import struct
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from .errors import KeyMismatchError, ModelStateError, SpecMismatchError, format_keys
from .reader import INDEX_NAME, SINGLE_NAME, bytes_view
from .specs import TensorSpec, dtype_to_safetensors

__all__ = [
    "DEFAULT_MAX_SHARD_SIZE",
    "CheckpointWriter",
    "clean_interrupted",
    "parse_size",
    "write_file_atomic",
]

log = logging.getLogger(__name__)

DEFAULT_MAX_SHARD_SIZE = 5 * 1024**3
_SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
_TMP_PREFIX = ".plait-tmp-"
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


def write_file_atomic(path: str | os.PathLike[str], data: bytes, *, fsync: bool = True) -> None:
    """Replace the file ``path`` by ``data`` atomically.

    ``data`` goes to a hidden temporary file in the same directory, is fsynced (``fsync=True``) and
    renamed over ``path`` (``os.replace``): a reader sees the old file or the new one, never a part.
    Nothing else in the directory is touched.
    """
    path = Path(path)
    tmp = path.with_name(f"{_TMP_PREFIX}{uuid.uuid4().hex[:12]}-{path.name}.tmp")
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            if fsync:
                fh.flush()
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _old_shards(out: Path) -> set[str]:
    """Shard files of the checkpoint already in ``out``: those its index lists with the writer's names."""
    try:
        weight_map = json.loads((out / INDEX_NAME).read_text())["weight_map"]
        names = set(weight_map.values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return set()  # no index, or one that cannot say which files are its shards: remove none
    return {n for n in names if isinstance(n, str) and _SHARD_NAME.fullmatch(n)}


def _exchange(a: Path, b: Path) -> bool:
    """Swap two directory entries in one step (Linux ``renameat2(RENAME_EXCHANGE)``); False where the
    system or file system cannot."""
    fn = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if fn is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(a))


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError:
        shutil.copy2(src, dst, follow_symlinks=False)


def _carry(src: Path, dst: Path) -> None:
    """Put ``src`` (a user's file, link or folder) at ``dst`` without copying data: hard links."""
    if src.is_symlink():
        os.symlink(os.readlink(src), dst)
    elif src.is_dir():
        shutil.copytree(src, dst, symlinks=True, copy_function=_link_or_copy)
    else:
        _link_or_copy(str(src), str(dst))


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def clean_interrupted(out_dir: Path) -> list[Path]:
    """Remove what an interrupted write into ``out_dir`` left: ``.plait-tmp-*`` files inside it and
    the ``.plait-tmp-*-<name>.new/.old`` folders of an interrupted publish beside it. A checkpoint
    directory that an interrupted swap left only under its ``.old`` name is put back first.

    Returns:
        The paths removed (or put back).
    """
    done: list[Path] = []
    parent, name = out_dir.parent, out_dir.name
    siblings = sorted(parent.glob(f"{_TMP_PREFIX}*-{name}.old")) + sorted(
        parent.glob(f"{_TMP_PREFIX}*-{name}.new")
    )
    if not out_dir.exists():
        for old in siblings:
            if old.name.endswith(".old"):
                os.replace(old, out_dir)  # the previous checkpoint, renamed away just before a crash
                done.append(old)
                break
    for p in siblings:
        if p.exists():
            _remove(p)
            done.append(p)
    if out_dir.is_dir():
        for p in out_dir.iterdir():
            if p.name.startswith(_TMP_PREFIX):
                _remove(p)
                done.append(p)
    for p in done:
        log.info("removed %s, left by an interrupted checkpoint write", p)
    return done


class CheckpointWriter:
    """Writes tensors into a sharded safetensors checkpoint as they arrive, atomically per file.

    The file layout (which key goes to which file, at which offset) is fixed from ``specs`` up
    front, so each tensor is written straight to its place and dropped: memory stays at one tensor,
    not one shard. Files go to hidden temporary names (``.plait-tmp-*``) inside ``out_dir``;
    :meth:`commit` fsyncs them and renames each over its Hugging Face name (``model.safetensors``
    or ``model-0000k-of-0000N.safetensors``), then replaces ``model.safetensors.index.json``
    (``weight_map``, ``metadata.total_size``, ``metadata``) the same way. A crash before the
    commit leaves any previous checkpoint at ``out_dir`` untouched (plus hidden temporaries).

    Only the writer's own files change: every other file or folder in ``out_dir`` (tokenizer,
    ``config.json``, README, subfolders) stays. Of a previous checkpoint in ``out_dir``, the writer
    removes what would otherwise shadow or mix with the new one: ``model.safetensors`` when the new
    checkpoint is sharded, the index when it is one file, and the ``model-*-of-*.safetensors``
    shards that the previous index listed and the new one does not.

    Distributed: every rank of ``group`` creates the writer with the specs *it* writes (possibly
    none: e.g. only one rank per pipeline stage writes); :meth:`commit` is collective, the group's
    first rank merges the index. Files of different ranks never share keys.

    Args:
        out_dir: the checkpoint directory (created if missing; its other files are kept).
        specs: key -> spec of every tensor this rank will write, in write order.
        max_shard_size: upper bound per file (a bigger single tensor gets its own file).
        metadata: string metadata stored in every file header and the index.
        group: process group of the writing job (default: the world when torch.distributed is
            initialised). ``distributed=False`` forces a single-process writer.
        fsync: fsync files (and the directory) before and after publishing.
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
        if self.rank == 0:  # before the broadcast: no rank has written a temporary of this writer yet
            clean_interrupted(self.out_dir)
        self._created = self.rank == 0 and not self.out_dir.exists()  # before any rank creates it
        if distributed:
            dist.broadcast_object_list(token, src=self._src(), group=group)
        self._make_out_dir()
        self._tmp_prefix = f"{_TMP_PREFIX}{token[0]}"
        self._files = self._layout(dict(specs), parse_size(max_shard_size))
        self._key_file = {k: f for f in self._files for k in f.entries}
        self._done = False

    def _make_out_dir(self) -> None:
        try:
            self.out_dir.mkdir(parents=True, exist_ok=True)
        except FileExistsError:
            raise ModelStateError(f"{self.out_dir} exists and is not a directory") from None

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
                    f"{self._tmp_prefix}-r{self.rank:05d}-{i:05d}.safetensors.tmp",
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
            f.fd = os.open(self.out_dir / f.name, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
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
        try:
            self._publish(files)
        except BaseException:
            self._discard(name for name, _, _ in files)
            raise

    def _publish(self, files: list[tuple[str, list[str], int]]) -> None:
        """Rename the parts over their final names, replace the index, drop the previous save's leftovers."""
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
        out = self.out_dir
        old_shards = _old_shards(out)
        if len(files) > 1 and ((out / SINGLE_NAME).exists() or (out / INDEX_NAME).exists()):
            self._publish_swapped(files, {SINGLE_NAME, INDEX_NAME, *old_shards})
            return
        if not files:
            write_file_atomic(out / SINGLE_NAME, _header({}, self.metadata), fsync=self.fsync)
            stale = {INDEX_NAME, *old_shards}
        elif len(files) == 1:
            os.replace(out / files[0][0], out / SINGLE_NAME)
            stale = {INDEX_NAME, *old_shards}
        else:  # no previous checkpoint here (else swapped above): the index goes last
            weight_map = self._shards(files, out)
            stale = {SINGLE_NAME, *(old_shards - set(weight_map.values()))}
        for name in sorted(stale):
            (out / name).unlink(missing_ok=True)
        if self.fsync:
            _fsync_dir(out)

    def _shards(self, files: list[tuple[str, list[str], int]], into: Path) -> dict[str, str]:
        """Rename the parts to their shard names in ``into``, write the index there; the weight map."""
        n = len(files)
        weight_map: dict[str, str] = {}
        for i, (name, keys, _) in enumerate(files):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(self.out_dir / name, into / final)
            weight_map.update(dict.fromkeys(keys, final))
        index = {
            "metadata": {**self.metadata, "total_size": sum(size for _, _, size in files)},
            "weight_map": dict(sorted(weight_map.items())),
        }
        write_file_atomic(into / INDEX_NAME, json.dumps(index, indent=2).encode(), fsync=self.fsync)
        return weight_map

    def _publish_swapped(self, files: list[tuple[str, list[str], int]], owned: set[str]) -> None:
        """Replace a previous checkpoint by a sharded one in one step: build the new directory beside
        ``out_dir`` (new shards and index, hard links to every file that is not the previous
        checkpoint's), then swap the two directories, so a reader sees the old checkpoint or the new
        one, never a mix of their shards."""
        out = self.out_dir
        stage = out.parent / f"{self._tmp_prefix}-{out.name}.new"
        stage.mkdir()
        os.chmod(stage, stat.S_IMODE(out.stat().st_mode))
        for entry in out.iterdir():
            if entry.name not in owned and not entry.name.startswith(_TMP_PREFIX):
                _carry(entry, stage / entry.name)
        self._shards(files, stage)
        if self.fsync:
            _fsync_dir(stage)
        if _exchange(stage, out):
            old = stage
        else:  # two renames; an interruption between them is repaired by the next writer
            old = out.parent / f"{self._tmp_prefix}-{out.name}.old"
            os.replace(out, old)
            os.replace(stage, out)
        for entry in old.iterdir():  # files a user added while the new directory was built
            if (
                entry.name not in owned
                and not entry.name.startswith(_TMP_PREFIX)
                and not (out / entry.name).exists()
            ):
                os.replace(entry, out / entry.name)
        shutil.rmtree(old, ignore_errors=True)
        if self.fsync:
            _fsync_dir(out.parent)

    def _discard(self, names: Iterable[str]) -> None:
        for name in names:
            (self.out_dir / name).unlink(missing_ok=True)

    def abort(self) -> None:
        """Discard the temporary files this rank wrote; nothing else in ``out_dir`` changes.

        The directory itself is removed only when this writer created it and it is still empty.
        """
        for f in self._files:
            if f.fd is not None:
                os.close(f.fd)
                f.fd = None
        self._done = True
        self._discard(f.name for f in self._files)
        if self._created:
            with contextlib.suppress(OSError):  # not empty: other ranks' temporaries, or others' files
                self.out_dir.rmdir()

    def __enter__(self) -> CheckpointWriter:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is None:
            self.commit()
        elif not self._done:
            self.abort()
