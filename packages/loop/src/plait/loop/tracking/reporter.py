"""Where a run's metrics go: the trackers (main rank), the progress bar and the console."""

from __future__ import annotations

import logging
import math
from collections.abc import MutableMapping, Sequence
from pathlib import Path
from typing import Any

from plait.loop.config import TrainerConfig
from plait.loop.tracking.trackers import Tracker, build_tracker

__all__ = ["RunReporter"]

logger = logging.getLogger("plait.loop")


class RunReporter:
    """Opens the trackers of ``config.logging`` (or the given ones) and a tqdm bar on the main rank.

    Args:
        config: the run's configuration (``logging`` section, run name and length).
        run_dir: the run directory (file trackers write there).
        is_main: whether this is the rank that reports (others do nothing).
        trackers: replace the trackers of ``config.logging.trackers``.
        run_ids: tracker run ids by kind, kept across resumes (updated when a tracker opens a new run).
    """

    def __init__(
        self,
        config: TrainerConfig,
        run_dir: Path,
        *,
        is_main: bool,
        trackers: Sequence[Tracker] | None,
        run_ids: MutableMapping[str, str],
    ) -> None:
        self.config, self.run_dir, self.is_main = config, run_dir, is_main
        self._given = list(trackers) if trackers is not None else None
        self.run_ids = run_ids
        self.trackers: list[Tracker] = []
        self._bar: Any = None

    def open(self, total: int, initial: int) -> None:
        """Open the trackers (once) and the progress bar for a run from step ``initial`` to ``total``."""
        if not self.is_main:
            return
        if not self.trackers:
            self.trackers = (
                self._given
                if self._given is not None
                else [self._build(tc, initial) for tc in self.config.logging.trackers]
            )
            for t in self.trackers:
                t.log_config(self.config.model_dump(mode="json"))
        if self.config.logging.progress_bar:
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=initial, dynamic_ncols=True, desc=self.config.run.name)

    def _build(self, tc: Any, start_step: int) -> Tracker:
        tracker = build_tracker(
            tc.kind,
            self.run_dir,
            project=tc.project or self.config.run.name,
            run_id=self.run_ids.get(tc.kind),
            total_steps=self.config.run.steps,
            start_step=start_step,
            write=self.write,
            **tc.options,
        )
        if tracker.run_id is not None:
            self.run_ids[tc.kind] = tracker.run_id
        return tracker

    def write(self, line: str) -> None:
        """A console line (above the progress bar when there is one)."""
        if self._bar is not None:
            self._bar.write(line)
        else:
            logger.info(line)

    def log(self, values: dict[str, float], step: int) -> None:
        """Send ``values`` of ``step`` to every tracker."""
        for t in self.trackers:
            t.log(values, step)

    def step_done(self, loss: float, seconds: float) -> None:
        """Advance the progress bar by one step (``loss`` is shown once one was read: not NaN)."""
        if self._bar is not None:
            self._bar.update(1)
            shown = {"loss": f"{loss:.4f}"} if not math.isnan(loss) else {}
            self._bar.set_postfix(**shown, s_per_step=f"{seconds:.2f}")

    def close_bar(self) -> None:
        """Close the progress bar (the end of a :meth:`~plait.loop.Trainer.fit`)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def close(self) -> None:
        """Close the trackers."""
        for t in self.trackers:
            t.close()
        self.trackers = []
