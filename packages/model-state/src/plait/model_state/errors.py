"""Exceptions raised by plait.model_state; each message names the keys or files at fault."""

from __future__ import annotations

from collections.abc import Iterable

__all__ = [
    "CheckpointFormatError",
    "KeyMismatchError",
    "MapperError",
    "ModelStateError",
    "SpecMismatchError",
]

_MAX_LISTED = 25


def format_keys(keys: Iterable[str], limit: int = _MAX_LISTED) -> str:
    """Render a sorted, bounded list of keys for an error message."""
    items = sorted(keys)
    shown = ", ".join(repr(k) for k in items[:limit])
    if len(items) > limit:
        shown += f", ... ({len(items) - limit} more)"
    return f"[{shown}]"


class ModelStateError(Exception):
    """Base class of every error raised by plait.model_state."""


class MapperError(ModelStateError, ValueError):
    """A mapper graph is inconsistent: overlapping outputs, inputs nobody provides, bad templates."""


class KeyMismatchError(ModelStateError, ValueError):
    """Keys produced by a mapper do not match the keys a module (or a writer) expects.

    Attributes:
        missing: target keys that nothing produces.
        unexpected: produced keys that the target does not have.
    """

    def __init__(self, message: str, missing: Iterable[str] = (), unexpected: Iterable[str] = ()) -> None:
        super().__init__(message)
        self.missing = sorted(missing)
        self.unexpected = sorted(unexpected)


class SpecMismatchError(ModelStateError, ValueError):
    """A tensor's shape or dtype differs from the one the target declares."""


class CheckpointFormatError(ModelStateError, ValueError):
    """A checkpoint file or index is unreadable: corrupted header, truncated data, broken index."""
