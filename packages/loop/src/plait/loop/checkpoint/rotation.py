"""The rotation phase: keep the newest complete checkpoints, delete older ones."""

from __future__ import annotations

from pathlib import Path

from plait.loop.checkpoint import _layout

__all__ = ["rotate"]


def rotate(root: Path, keep_last: int) -> list[Path]:
    """Delete all but the newest ``keep_last`` complete checkpoints under ``root``; returns those deleted."""
    old = [info.path for info in _layout.list_complete(root)[:-keep_last]]
    for path in old:
        _layout.remove(path)
    return old
