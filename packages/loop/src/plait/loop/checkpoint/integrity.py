"""The finalise phase: the marker with each file's size (and CRC32), atomic visibility, and the
check of a checkpoint's files against its marker."""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path
from typing import Any

from plait.loop.checkpoint import _layout

__all__ = ["damage", "file_record", "fsync", "publish"]


def file_record(path: Path, checksum: bool) -> dict[str, int]:
    """The marker's record of file ``path``: its size and, with ``checksum``, its CRC32."""
    record = {"size": path.stat().st_size}
    if checksum:
        crc = 0
        with path.open("rb") as f:
            while chunk := f.read(1 << 24):
                crc = zlib.crc32(chunk, crc)
        record["crc32"] = crc
    return record


def damage(path: Path, meta: dict, *, checksums: bool = True) -> str | None:
    """What is wrong with the files of checkpoint ``path`` against its marker ``meta``, or None.

    Checks that every file the marker lists exists with its recorded size, and (with
    ``checksums``, where the marker has them) its CRC32. A marker without a file list is damage
    too: nothing could be checked against it.
    """
    files = meta.get("files")
    if not isinstance(files, dict) or not files:
        return f"its marker {_layout.MARKER} lists no files (nothing to check them against)"
    for name, want in files.items():
        f = path / name
        if not f.is_file():
            return f"file {name} is missing"
        size = f.stat().st_size
        if size != want.get("size"):
            return f"file {name} has {size} bytes, the marker recorded {want.get('size')} (truncated or overwritten)"
        if checksums and "crc32" in want and file_record(f, True)["crc32"] != want["crc32"]:
            return f"file {name} does not match its recorded CRC32 (corrupt)"
    return None


def fsync(path: Path) -> None:
    """Flush file or directory ``path`` to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(partial: Path, final: Path, meta: dict[str, Any], *, checksums: bool) -> None:
    """Write the marker (``meta`` and every file's record) into ``partial`` and rename it to
    ``final``: the checkpoint becomes visible atomically, complete. Run by one rank only."""
    files = {f.name: file_record(f, checksums) for f in sorted(partial.iterdir()) if f.is_file()}
    marker = partial / _layout.MARKER
    marker.write_text(json.dumps({**meta, "files": files}))
    fsync(marker)
    _layout.remove(final)
    os.replace(partial, final)
    fsync(final.parent)
