"""The end-of-run summary: what a run did, printed and written to ``<run_dir>/summary.json``."""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from plait.loop.events import EventBus, MetricsLogged, TrainingEnd, TrainingStart
from plait.loop.tracking.plots import plot_loss_curve

__all__ = ["RunSummary", "RunSummaryCollector", "RunTotals"]

logger = logging.getLogger("plait.loop")

# Peak memory keys of plait.loop.tracking.device_memory_stats (CUDA, then CPU).
_MEMORY_KEYS = ("mem_allocated_gib", "max_rss_gib")


@dataclass(frozen=True)
class RunSummary:
    """What a training run did (over the :meth:`~plait.loop.Trainer.fit` calls of this process).

    ``steps``, ``skipped_steps`` (non-finite steps skipped under ``determinism.nonfinite_loss="skip"``)
    and ``tokens`` are the run's totals (a resumed run includes what was done before the resume);
    ``final_loss`` is the last logged loss (None when it was not finite); ``error`` the exception that
    ended :meth:`~plait.loop.Trainer.fit`, if one did. ``steps_this_session``, ``wall_time_s``,
    ``mean_tokens_per_s`` and ``mean_mfu`` cover this process's training loop only, warm-up and
    compilation included. ``steady_tokens_per_s`` and ``steady_mfu`` cover its logging intervals after
    the first one, less any interval in which torch.compile compiled a graph (evaluation time is left
    out of both); ``steady_steps`` counts their steps (0 when no interval qualifies: the steady figures
    are None then). ``last_val_loss`` and ``best_val_loss`` (at ``best_val_step``) come from the
    evaluations of this session. ``stragglers`` maps each rank that was flagged as a straggler in a
    logging interval (``logging.straggler_threshold``) to that interval count and its largest lag.
    """

    steps: int
    total_steps: int
    stopped_early: bool
    steps_this_session: int
    skipped_steps: int
    tokens: int
    wall_time_s: float
    final_loss: float | None
    mean_tokens_per_s: float
    mean_mfu: float | None
    steady_steps: int
    steady_tokens_per_s: float | None
    steady_mfu: float | None
    last_val_loss: float | None
    best_val_loss: float | None
    best_val_step: int | None
    peak_memory_gib: float | None
    checkpoint: str | None
    export: str | None
    error: str | None = None
    stragglers: dict[str, dict[str, float]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """Plain values (what ``summary.json`` holds)."""
        return asdict(self)

    def format(self) -> str:
        """A few human-readable lines; figures that were not measured are left out."""

        def rate(tps: float, mfu: float | None) -> str:
            return f"{tps:,.0f} tok/s" + ("" if mfu is None else f", MFU {100 * mfu:.2f}%")

        state = "FAILED" if self.error else "stopped early" if self.stopped_early else "finished"
        skipped = f", {self.skipped_steps} skipped" if self.skipped_steps else ""
        losses = [] if self.final_loss is None else [f"final loss {self.final_loss:.4f}"]
        if self.last_val_loss is not None:
            losses.append(
                f"val_loss {self.last_val_loss:.4f} (best {self.best_val_loss:.4f} at step {self.best_val_step})"
            )
        if self.peak_memory_gib is not None:
            losses.append(f"peak memory {self.peak_memory_gib:.2f} GiB")
        speed = f"whole run {rate(self.mean_tokens_per_s, self.mean_mfu)} over {self.wall_time_s:.1f} s"
        if self.steady_tokens_per_s is not None:
            speed = (
                f"steady state {rate(self.steady_tokens_per_s, self.steady_mfu)} ({self.steady_steps} steps) | "
                + speed
            )
        lines = [
            f"run {state}: step {self.steps}/{self.total_steps} ({self.steps_this_session} this session{skipped}), "
            f"{self.tokens:,} tokens, {self.wall_time_s:.1f} s",
            *([f"  error: {self.error}"] if self.error else []),
            f"  {speed}",
        ]
        if losses:
            lines.append("  " + " | ".join(losses))
        if self.stragglers:
            ranks = ", ".join(
                f"rank {r} ({s['intervals']:.0f} intervals, lag up to {s['max_lag_s']:.3f} s/step)"
                for r, s in self.stragglers.items()
            )
            lines.append(f"  stragglers: {ranks}")
        lines += [f"  checkpoint: {self.checkpoint or 'none'}", f"  export: {self.export or 'none'}"]
        return "\n".join(lines)


@dataclass(frozen=True)
class RunTotals:
    """The run's counters when its summary is taken (what :meth:`~plait.loop.Trainer.totals` returns).

    Attributes:
        step: completed optimizer steps, skipped ones included (a resumed run's included).
        total_steps: the run's length (``run.steps``).
        skipped_steps: steps skipped for non-finite values.
        tokens_seen: positions trained on over all data-parallel ranks.
        checkpoint: the newest complete checkpoint, if there is one.
    """

    step: int
    total_steps: int
    skipped_steps: int
    tokens_seen: int
    checkpoint: Path | None = None


class RunSummaryCollector:
    """Follows a run's events (start, logged metrics, end) and builds its :class:`RunSummary` from them
    and the :class:`RunTotals` it is given.

    Args:
        events: the bus the trainer publishes on (:class:`TrainingStart`, :class:`MetricsLogged` with its
            throughput ``interval``, :class:`TrainingEnd` are read).
        mfu: the model FLOPs utilisation of a global tokens-per-second rate, or None when unknown
            (:meth:`~plait.loop.tracking.ThroughputMeter.mfu`).
        is_main: whether this rank prints and writes the summary.
    """

    def __init__(self, events: EventBus, *, mfu: Callable[[float], float | None], is_main: bool) -> None:
        self.export: str | Path | None = None  # set by the script that writes an export
        self._mfu, self._is_main = mfu, is_main
        self._t0: float | None = None
        self._t1: float | None = None
        self._start_step = 0
        self._start_tokens = 0
        self._stopped_early = False
        self._final_loss: float | None = None
        self._error: str | None = None
        self._peak_memory: float | None = None
        self._steady_tokens = 0
        self._steady_seconds = 0.0
        self._steady_steps = 0
        self._intervals = 0
        self._last_logged_step: int | None = None
        self._val: list[tuple[int, float]] = []  # (step, val_loss) of each evaluation
        self._stragglers: dict[str, dict[str, float]] = {}  # rank -> flagged intervals, largest lag
        events.subscribe(TrainingStart, self._on_start)
        events.subscribe(MetricsLogged, self._on_metrics)
        events.subscribe(TrainingEnd, self._on_end)

    def _on_start(self, e: TrainingStart) -> None:
        if self._t0 is None:
            self._t0 = time.perf_counter()
            self._start_step = e.step
            self._start_tokens = e.tokens_seen
        self._last_logged_step = e.step
        self._intervals = 0  # each fit() warms up again (its first interval is left out)

    def _on_metrics(self, e: MetricsLogged) -> None:
        loss = e.metrics.get("loss")
        if loss is not None:
            self._final_loss = float(loss) if math.isfinite(loss) else None
        for key in _MEMORY_KEYS:
            if key in e.metrics:
                self._peak_memory = max(self._peak_memory or 0.0, float(e.metrics[key]))
        val = e.metrics.get("val_loss")
        if val is not None and math.isfinite(val):
            self._val.append((e.step, float(val)))
        if e.metrics.get("straggler_flagged"):
            seen = self._stragglers.setdefault(
                str(int(e.metrics["straggler_rank"])), {"intervals": 0, "max_lag_s": 0.0}
            )
            seen["intervals"] += 1
            seen["max_lag_s"] = max(seen["max_lag_s"], float(e.metrics["straggler_lag_s"]))
        interval = e.interval
        if "tokens_per_s" in e.metrics and interval is not None:  # a training interval was measured
            if self._intervals > 0 and not interval.compiled:
                self._steady_tokens += interval.tokens
                self._steady_seconds += interval.seconds
                self._steady_steps += e.step - (self._last_logged_step or 0)
            self._intervals += 1
            self._last_logged_step = e.step

    def failed(self, error: BaseException) -> None:
        """Record the exception that ended the run (the trainer calls it; the summary then says FAILED)."""
        self._error = f"{type(error).__name__}: {str(error).strip()}"

    def _on_end(self, e: TrainingEnd) -> None:
        self._t1 = time.perf_counter()
        self._stopped_early = e.stopped_early

    def summary(self, totals: RunTotals) -> RunSummary:
        """The summary so far, with the run's ``totals`` now (a run without a :class:`TrainingEnd` counts
        as stopped early)."""
        now = time.perf_counter()
        wall = (self._t1 or now) - (self._t0 or now)
        tokens = totals.tokens_seen - self._start_tokens
        tps = tokens / wall if wall > 0 else 0.0
        steady = self._steady_tokens / self._steady_seconds if self._steady_seconds > 0 else None
        best = min(self._val, key=lambda sv: sv[1]) if self._val else None
        return RunSummary(
            steps=totals.step,
            total_steps=totals.total_steps,
            stopped_early=self._stopped_early or self._t1 is None,
            steps_this_session=totals.step - self._start_step,
            skipped_steps=totals.skipped_steps,
            tokens=totals.tokens_seen,
            wall_time_s=wall,
            final_loss=self._final_loss,
            mean_tokens_per_s=tps,
            mean_mfu=self._mfu(tps),
            steady_steps=self._steady_steps if steady is not None else 0,
            steady_tokens_per_s=steady,
            steady_mfu=self._mfu(steady) if steady is not None else None,
            last_val_loss=self._val[-1][1] if self._val else None,
            best_val_loss=best[1] if best else None,
            best_val_step=best[0] if best else None,
            peak_memory_gib=self._peak_memory,
            checkpoint=str(totals.checkpoint) if totals.checkpoint is not None else None,
            export=str(self.export) if self.export is not None else None,
            error=self._error,
            stragglers={r: dict(s) for r, s in sorted(self._stragglers.items(), key=lambda rs: int(rs[0]))},
        )

    def write(self, run_dir: str | Path, totals: RunTotals) -> RunSummary | None:
        """On the main rank: print the summary, write ``summary.json`` and ``loss_curve.png`` (from
        ``metrics.jsonl``, when there is one) into ``run_dir``. Returns the summary (None elsewhere,
        before training started, or after a session that trained no step of a run that already has a
        ``summary.json``: a rerun of a finished run leaves its summary as it was)."""
        if not self._is_main or self._t0 is None:
            return None
        if (
            totals.step == self._start_step
            and self._error is None
            and (Path(run_dir) / "summary.json").is_file()
        ):
            return None
        summary = self.summary(totals)
        run_dir = Path(run_dir)
        tmp = run_dir / ".summary.json.tmp"
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(summary.to_dict(), indent=2))
            os.replace(tmp, run_dir / "summary.json")
            text = summary.format() + f"\n  summary: {run_dir / 'summary.json'}"
        except OSError as e:  # e.g. the disk that a failed save filled: say so, do not hide the run's error
            tmp.unlink(missing_ok=True)
            text = (
                summary.format() + f"\n  summary not written to {run_dir / 'summary.json'}: {e.strerror or e}"
            )
            return self._print(text, summary)
        metrics = run_dir / "metrics.jsonl"
        if metrics.is_file():
            try:
                if plot_loss_curve(metrics, run_dir / "loss_curve.png"):
                    text += f"\n  loss curve: {run_dir / 'loss_curve.png'}"
            except ImportError as e:
                text += f"\n  loss curve not plotted: {e}"
            except OSError as e:
                text += f"\n  loss curve not written: {e.strerror or e}"
        return self._print(text, summary)

    @staticmethod
    def _print(text: str, summary: RunSummary) -> RunSummary:
        print(text, flush=True)
        return summary
