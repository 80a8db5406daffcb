"""Line plots written as PNG files (matplotlib, the ``viz`` extra): LR schedules, loss curves."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

__all__ = ["plot_loss_curve", "plot_series"]


def plot_series(
    xs: Sequence[float],
    ys: Sequence[float],
    path: str | Path,
    *,
    xlabel: str,
    ylabel: str,
    label: str | None = None,
    extra: Sequence[tuple[Sequence[float], Sequence[float], str]] = (),
) -> None:
    """Write a PNG of one line ``ys`` over ``xs`` (named ``label``), plus ``extra`` lines ``(xs, ys, label)``
    drawn with markers; a legend appears when there are extra lines.

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
    ax.plot(list(xs), list(ys), label=label)
    for exs, eys, elabel in extra:
        ax.plot(list(exs), list(eys), marker="o", label=elabel)
    if extra:
        ax.legend()
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_loss_curve(metrics: str | Path, path: str | Path) -> int:
    """Plot the ``loss`` of each step recorded in a ``metrics.jsonl`` file, and its ``val_loss`` (of the
    evaluations) beside it; returns the number of training-loss points.

    Non-finite or missing losses are left out; nothing is written when no step has a loss.
    """
    points: dict[int, float] = {}
    val: dict[int, float] = {}
    for line in Path(metrics).read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            continue
        for key, into in (("loss", points), ("val_loss", val)):
            value = record.get(key)
            if isinstance(value, int | float) and math.isfinite(value):
                into[record["step"]] = float(value)  # a later record of a step (a redone step) wins
    if points:
        steps, vsteps = sorted(points), sorted(val)
        extra = [(vsteps, [val[s] for s in vsteps], "val_loss")] if val else []
        plot_series(
            steps, [points[s] for s in steps], path, xlabel="step", ylabel="loss", label="loss", extra=extra
        )
    return len(points)
