"""On-disk layout of a checkpoint root: which step directories are complete, which are not.

A checkpoint is written into ``.step_XXXXXXXX.partial`` and renamed to ``step_XXXXXXXX`` by the
main rank only after every rank finished writing and the marker file is in place, so a reader
never sees a half-written checkpoint under its final name.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

MARKER = "plait_checkpoint.json"
_COMPLETE = re.compile(r"^step_(\d{8,})$")
_PARTIAL = re.compile(r"^\.step_(\d{8,})\.(partial|removing)$")  # being written / being deleted


def final_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def partial_dir(root: Path, step: int) -> Path:
    return root / f".step_{step:08d}.partial"


@dataclass(frozen=True)
class CheckpointInfo:
    """A complete checkpoint: its directory, step and the marker's metadata."""

    path: Path
    step: int
    meta: dict


def list_complete(root: Path) -> list[CheckpointInfo]:
    """Complete checkpoints under ``root``, oldest first (final name and a readable marker)."""
    found: list[CheckpointInfo] = []
    if not root.is_dir():
        return found
    for child in root.iterdir():
        m = _COMPLETE.match(child.name)
        if not m or not (child / MARKER).is_file():
            continue
        try:
            meta = json.loads((child / MARKER).read_text())
        except (OSError, json.JSONDecodeError):
            continue
        found.append(CheckpointInfo(child, int(m.group(1)), meta))
    return sorted(found, key=lambda c: c.step)


def list_incomplete(root: Path) -> list[Path]:
    """Leftovers of interrupted saves: partial directories, or step directories without a marker."""
    if not root.is_dir():
        return []
    out = []
    for child in root.iterdir():
        if _PARTIAL.match(child.name) or (_COMPLETE.match(child.name) and not (child / MARKER).is_file()):
            out.append(child)
    return sorted(out)


def remove(path: Path) -> None:
    """Delete a checkpoint directory: renamed to a hidden ``.step_XXXXXXXX.removing`` first (one atomic
    step), then deleted, so that a crash during the deletion never leaves a visible step directory
    without its files; the hidden leftover is an incomplete checkpoint, cleaned like a partial one."""
    m = _COMPLETE.match(path.name)
    if m is not None:
        hidden = path.with_name(f".step_{m.group(1)}.removing")
        shutil.rmtree(hidden, ignore_errors=True)  # the leftover of an earlier crash
        try:
            path.rename(hidden)
            path = hidden
        except OSError:
            pass  # gone already, or not renamable: delete it where it is
    shutil.rmtree(path, ignore_errors=True)
