"""torch.profiler windows writing one chrome trace per rank and window."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from plait.loop.config.sections import ProfilingConfig

__all__ = ["StepProfiler"]


class StepProfiler:
    """Wraps ``torch.profiler.profile`` with a wait/warmup/active/repeat schedule; call :meth:`step` per step.

    Traces go to ``<out_dir>/rank<R>_step<N>.json`` (open them in Perfetto or chrome://tracing).
    Disabled configs make every method a no-op.
    """

    def __init__(self, config: ProfilingConfig, out_dir: str | Path, rank: int) -> None:
        self.config = config
        self.out_dir = Path(out_dir)
        self.rank = rank
        self.traces: list[Path] = []
        self._prof: Any = None

    def _on_trace(self, prof: Any) -> None:
        path = self.out_dir / f"rank{self.rank}_step{prof.step_num}.json"
        prof.export_chrome_trace(str(path))
        self.traces.append(path)

    def start(self) -> None:
        """Begin profiling (no-op when disabled)."""
        if not self.config.enabled:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        c = self.config
        self._prof = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(wait=c.wait, warmup=c.warmup, active=c.active, repeat=c.repeat),
            on_trace_ready=self._on_trace,
            record_shapes=c.record_shapes,
            profile_memory=c.profile_memory,
            with_stack=c.with_stack,
        )
        self._prof.start()

    def step(self) -> None:
        """Mark the end of a training step."""
        if self._prof is not None:
            self._prof.step()

    def stop(self) -> None:
        """Stop profiling (flushes a window in progress)."""
        if self._prof is not None:
            self._prof.stop()
            self._prof = None
