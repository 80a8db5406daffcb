"""Line plots written as PNG files (matplotlib, the ``viz`` extra): LR schedules, loss curves."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

__all__ = ["plot_loss_curve", "plot_series"]


def plot_series(
    xs: Sequence[float], ys: Sequence[float], path: str | Path, *, xlabel: str, ylabel: str
) -> None:
    """Write a PNG of one line ``ys`` over ``xs``.

    Raises:
        ImportError: without matplotlib (``pip install 'plait-loop[viz]'``).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            f"plotting {Path(path).name} needs matplotlib: pip install 'plait-loop[viz]'"
        ) from e
    fig, ax = plt.subplots(figsize=(6, 3))
    ax.plot(list(xs), list(ys))
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_loss_curve(metrics: str | Path, path: str | Path) -> int:
    """Plot the ``loss`` of each step recorded in a ``metrics.jsonl`` file; returns the number of points.

    Non-finite or missing losses are left out; nothing is written when no step has a loss.
    """
    points: dict[int, float] = {}
    for line in Path(metrics).read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        loss = record.get("loss")
        if isinstance(record.get("step"), int) and isinstance(loss, int | float) and math.isfinite(loss):
            points[record["step"]] = float(loss)  # a later record of a step (a redone step) wins
    if points:
        steps = sorted(points)
        plot_series(steps, [points[s] for s in steps], path, xlabel="step", ylabel="training loss")
    return len(points)
