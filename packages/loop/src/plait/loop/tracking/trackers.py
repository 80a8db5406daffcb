"""Experiment trackers: JSONL (the default), console, TensorBoard, aim, wandb (offline)."""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "AimTracker",
    "ConsoleTracker",
    "JSONLTracker",
    "TensorBoardTracker",
    "Tracker",
    "WandbTracker",
    "build_tracker",
    "register_tracker",
]

logger = logging.getLogger("plait.loop")


@runtime_checkable
class Tracker(Protocol):
    """Receives synchronised metrics on the main rank."""

    run_id: str | None

    def log_config(self, config: Mapping[str, Any]) -> None:
        """Record the run's configuration once."""
        ...

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        """Record one step's metrics."""
        ...

    def close(self) -> None:
        """Flush and release resources."""
        ...


def _clean(v: float) -> float | None:
    return None if isinstance(v, float) and not math.isfinite(v) else v


class JSONLTracker:
    """Appends one JSON object per logged step to ``<run_dir>/metrics.jsonl`` (``config.json`` beside it).

    Non-finite values are written as ``null``. A run that resumes from step ``start_step`` continues
    the same file after dropping its records of later steps (they are redone), so each step has
    exactly one record; ``start_step=None`` keeps every record.
    """

    def __init__(
        self, run_dir: str | Path, filename: str = "metrics.jsonl", start_step: int | None = None
    ) -> None:
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / filename
        if start_step is not None and self.path.exists():
            _drop_records_after(self.path, start_step)
        self._f = open(self.path, "a", buffering=1)  # noqa: SIM115 - kept open for the run
        self.run_id: str | None = None

    def log_config(self, config: Mapping[str, Any]) -> None:
        (self.dir / "config.json").write_text(json.dumps(config, indent=2, default=str))

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        record = {"step": step, "time": time.time(), **{k: _clean(v) for k, v in metrics.items()}}
        self._f.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self._f.close()


def _drop_records_after(path: Path, step: int) -> None:
    """Rewrite a metrics file atomically without its records of steps after ``step``."""
    lines = path.read_text().splitlines(keepends=True)
    kept = []
    for line in lines:
        try:
            record_step = json.loads(line).get("step")
        except (json.JSONDecodeError, AttributeError):
            record_step = None  # an unreadable (e.g. half-written) line is not kept either
        if isinstance(record_step, int) and record_step <= step:
            kept.append(line if line.endswith("\n") else line + "\n")
    if len(kept) == len(lines):
        return
    logger.info(
        "%s: replacing the %d records after step %d (the resumed run redoes them)",
        path,
        len(lines) - len(kept),
        step,
    )
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(kept))
    os.replace(tmp, path)


class ConsoleTracker:
    """One line per logged step through ``write`` (``tqdm.write`` keeps a progress bar intact)."""

    _ORDER = ("loss", "lr", "grad_norm", "tokens_per_s", "mfu")

    def __init__(self, write: Callable[[str], None] | None = None, total_steps: int | None = None) -> None:
        self.write = write or logger.info
        self.total_steps = total_steps
        self.run_id: str | None = None

    def log_config(self, config: Mapping[str, Any]) -> None:
        pass

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        keys = [k for k in self._ORDER if k in metrics] + sorted(k for k in metrics if k not in self._ORDER)
        total = f"/{self.total_steps}" if self.total_steps else ""
        parts = [f"step {step}{total}"] + [f"{k} {_fmt(metrics[k])}" for k in keys]
        self.write(" | ".join(parts))

    def close(self) -> None:
        pass


def _fmt(v: float) -> str:
    if isinstance(v, int) or (abs(v) >= 1000 and float(v).is_integer()):
        return f"{int(v)}"
    return f"{v:.4g}" if abs(v) >= 1e-3 or v == 0 else f"{v:.3e}"


def _need(module: str, extra: str, tracker: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"the {tracker} tracker needs {module!r}: pip install 'plait-loop[{extra}]'") from e


class TensorBoardTracker:
    """Scalars to TensorBoard event files under ``<run_dir>/tensorboard`` (extra ``tensorboard``).

    A run resumed from step ``start_step`` purges the events of later steps (TensorBoard's
    ``purge_step``), so the redone steps are not shown twice.
    """

    def __init__(self, run_dir: str | Path, start_step: int | None = None) -> None:
        _need("tensorboard", "tensorboard", "tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        purge = start_step + 1 if start_step else None
        self._w = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"), purge_step=purge)
        self.run_id: str | None = None

    def log_config(self, config: Mapping[str, Any]) -> None:
        self._w.add_text("config", "```\n" + json.dumps(config, indent=2, default=str) + "\n```")

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        for k, v in metrics.items():
            self._w.add_scalar(k, v, step)

    def close(self) -> None:
        self._w.close()


class AimTracker:
    """Metrics to an aim repository (default ``<run_dir>/aim``; extra ``aim``); resumable by ``run_id``."""

    def __init__(self, run_dir: str | Path, experiment: str | None = None, run_id: str | None = None) -> None:
        aim = _need("aim", "aim", "aim")
        repo = Path(run_dir) / "aim"
        repo.mkdir(parents=True, exist_ok=True)
        self._run = aim.Run(run_hash=run_id, repo=str(repo), experiment=experiment)
        self.run_id: str | None = str(self._run.hash)

    def log_config(self, config: Mapping[str, Any]) -> None:
        self._run["config"] = json.loads(json.dumps(config, default=str))

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        for k, v in metrics.items():
            self._run.track(v, name=k, step=step)

    def close(self) -> None:
        self._run.close()


class WandbTracker:
    """Metrics to Weights & Biases, offline by default (extra ``wandb``); resumable by ``run_id``."""

    def __init__(
        self,
        run_dir: str | Path,
        project: str | None = None,
        run_id: str | None = None,
        mode: str = "offline",
    ) -> None:
        wandb = _need("wandb", "wandb", "wandb")
        self._run = wandb.init(
            project=project or "plait",
            dir=str(run_dir),
            mode=mode,
            id=run_id,
            resume="allow" if run_id else None,
        )
        self.run_id: str | None = str(self._run.id)

    def log_config(self, config: Mapping[str, Any]) -> None:
        self._run.config.update(json.loads(json.dumps(config, default=str)), allow_val_change=True)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self._run.log(dict(metrics), step=step)

    def close(self) -> None:
        self._run.finish()


_FACTORIES: dict[str, Callable[..., Tracker]] = {}


def register_tracker(kind: str, factory: Callable[..., Tracker]) -> None:
    """Make ``kind`` buildable by :func:`build_tracker`: ``factory(run_dir=..., project=..., run_id=..., **options)``."""
    _FACTORIES[kind] = factory


def build_tracker(
    kind: str,
    run_dir: str | Path,
    *,
    project: str | None = None,
    run_id: str | None = None,
    total_steps: int | None = None,
    write: Callable[[str], None] | None = None,
    start_step: int | None = None,
    **options: Any,
) -> Tracker:
    """Build a tracker by kind (``jsonl``, ``console``, ``tensorboard``, ``aim``, ``wandb`` or registered).

    ``start_step`` is the step the run starts (or resumes) from: ``jsonl`` and ``tensorboard``
    replace what they recorded after it; ``aim`` and ``wandb`` continue the run ``run_id``.

    Raises:
        ValueError: naming an unknown kind.
    """
    if kind == "jsonl":
        return JSONLTracker(run_dir, start_step=start_step, **options)
    if kind == "console":
        return ConsoleTracker(write, total_steps)
    if kind == "tensorboard":
        return TensorBoardTracker(run_dir, start_step=start_step)
    if kind == "aim":
        return AimTracker(run_dir, experiment=project, run_id=run_id)
    if kind == "wandb":
        return WandbTracker(run_dir, project=project, run_id=run_id, **options)
    if kind in _FACTORIES:
        return _FACTORIES[kind](run_dir=run_dir, project=project, run_id=run_id, **options)
    raise ValueError(f"logging.trackers: unknown tracker kind {kind!r}")
