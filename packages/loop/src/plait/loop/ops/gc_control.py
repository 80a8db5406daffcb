"""Garbage-collection control: automatic GC off, explicit collections every N steps on every rank.

Automatic GC pauses at random moments on different ranks stall collectives; collecting at the same
step everywhere keeps ranks in lockstep.
"""

from __future__ import annotations

import gc

from plait.loop.config.sections import GCConfig

__all__ = ["GCController"]


class GCController:
    """Apply a :class:`GCConfig`: :meth:`start` disables automatic GC, :meth:`step` collects, :meth:`stop` restores."""

    def __init__(self, config: GCConfig) -> None:
        self.config = config
        self._was_enabled = gc.isenabled()
        self.collections = 0

    def start(self) -> None:
        """Disable automatic collection (when configured) and collect once."""
        self._was_enabled = gc.isenabled()
        if self.config.disable_automatic:
            gc.disable()
            gc.collect()

    def step(self, step: int) -> None:
        """Collect after step ``step`` when it is a multiple of the interval."""
        if self.config.interval and step % self.config.interval == 0:
            gc.collect(self.config.generation)
            self.collections += 1

    def stop(self) -> None:
        """Restore the automatic-GC setting found at :meth:`start`."""
        if self._was_enabled:
            gc.enable()
