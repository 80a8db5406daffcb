"""Piecewise learning-rate schedules: warmup, cosine, linear, constant, exponential, polynomial.

A schedule is a list of segments. Each segment lasts a number of steps (an ``int``) or a fraction of
the run (a ``float`` in (0, 1]); at most one segment may leave its duration out and takes the rest.
Each segment moves the LR *multiplier* (of the optimizer's base LR) from ``start`` to ``end``;
``start=None`` continues from where the previous segment ended.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Annotated, Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["LRScheduleConfig", "LRSegment", "PiecewiseLR", "plot_schedule"]

_Kind = Literal["linear", "cosine", "constant", "exponential", "polynomial"]


class LRSegment(BaseModel):
    """One piece of a schedule.

    Attributes:
        kind: the curve's shape. ``exponential`` interpolates geometrically (``start`` and ``end`` > 0),
            ``polynomial`` follows ``end + (start - end) * (1 - t) ** power``.
        duration: steps (int >= 1), a fraction of the run (float in (0, 1]), or None for the rest.
        start: multiplier at the segment's first step; None continues from the previous segment
            (1.0 for the first segment).
        end: multiplier reached at the segment's end (``constant`` ignores it).
    """

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    kind: _Kind = Field(
        description="Curve: linear, cosine, constant, exponential (geometric) or polynomial (with power)."
    )
    duration: Annotated[int, Field(ge=1)] | Annotated[float, Field(gt=0, le=1)] | None = Field(
        default=None,
        description="Steps (int >= 1), a fraction of run.steps (float in (0, 1]), or None: the rest.",
    )
    start: float | None = Field(
        default=None,
        ge=0,
        description="LR multiplier at the first step (None: the previous segment's end, 1.0 first).",
    )
    end: float = Field(
        default=1.0, ge=0, description="LR multiplier reached at the segment's end (constant ignores it)."
    )
    power: float = Field(
        default=1.0,
        gt=0,
        description="Exponent of a polynomial segment: end + (start - end) * (1 - t) ** power.",
    )

    @model_validator(mode="after")
    def _check(self) -> LRSegment:
        if self.kind == "exponential" and (self.end <= 0 or (self.start is not None and self.start <= 0)):
            raise ValueError(
                f"an exponential segment needs start and end > 0, got start={self.start}, end={self.end}"
            )
        return self


class LRScheduleConfig(BaseModel):
    """A piecewise schedule; the default is 5% linear warmup from 0, then cosine decay to 10%."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    segments: tuple[LRSegment, ...] = Field(
        default=(
            LRSegment(kind="linear", duration=0.05, start=0.0, end=1.0),
            LRSegment(kind="cosine", duration=None, end=0.1),
        ),
        description="[[lr_schedule.segments]] tables, in order; at most one may leave duration out.",
    )

    @model_validator(mode="after")
    def _check(self) -> LRScheduleConfig:
        if not self.segments:
            raise ValueError("lr_schedule.segments must not be empty")
        open_ended = [i for i, s in enumerate(self.segments) if s.duration is None]
        if len(open_ended) > 1:
            raise ValueError(
                f"lr_schedule.segments: only one segment may leave duration out, got {open_ended}"
            )
        return self

    def resolve(self, total_steps: int) -> list[tuple[int, int, LRSegment, float]]:
        """Segments as ``(first_step, num_steps, segment, start_multiplier)`` for a run of ``total_steps``.

        Raises:
            ValueError: when the fixed durations exceed ``total_steps``.
        """
        fixed = [
            0
            if s.duration is None
            else (s.duration if isinstance(s.duration, int) else round(s.duration * total_steps))
            for s in self.segments
        ]
        used = sum(fixed)
        if used > total_steps:
            raise ValueError(
                f"lr_schedule.segments: durations add up to {used} steps, more than run.steps={total_steps}"
            )
        out: list[tuple[int, int, LRSegment, float]] = []
        step, prev = 0, 1.0
        for seg, n in zip(self.segments, fixed):
            if seg.duration is None:
                n = total_steps - used
            start = prev if seg.start is None else seg.start
            out.append((step, n, seg, start))
            step += n
            prev = start if seg.kind == "constant" else seg.end
        return out

    def multiplier(self, step: int, total_steps: int) -> float:
        """The LR multiplier applied at optimizer step ``step`` (0-based)."""
        return _multiplier(self.resolve(total_steps), step)


def _multiplier(resolved: Sequence[tuple[int, int, LRSegment, float]], step: int) -> float:
    last = 1.0
    for first, n, seg, start in resolved:
        if n == 0:
            continue
        end = start if seg.kind == "constant" else seg.end
        if step < first + n:
            t = max(step - first, 0) / n
            if seg.kind == "constant":
                return start
            if seg.kind == "linear":
                return start + (end - start) * t
            if seg.kind == "cosine":
                return end + (start - end) * 0.5 * (1.0 + math.cos(math.pi * t))
            if seg.kind == "exponential":
                return start * (end / start) ** t
            return end + (start - end) * (1.0 - t) ** seg.power
        last = end
    return last


class PiecewiseLR:
    """Sets each param group's ``lr`` to ``initial_lr * multiplier(step)``; stateful for checkpoints.

    Call :meth:`step` after each optimizer step. The multiplier for step 0 is applied at construction.

    Args:
        optimizer: the optimizer(s) whose groups it drives (``initial_lr`` is recorded per group).
        config: the schedule.
        total_steps: the run's length, which fractional durations refer to.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
        config: LRScheduleConfig,
        total_steps: int,
    ) -> None:
        self.optimizers = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer)
        self.config = config
        self.total_steps = total_steps
        self._resolved = config.resolve(total_steps)
        for group in self._groups():
            group.setdefault("initial_lr", float(group["lr"]))
        self.last_step = 0
        self._apply()

    def _apply(self) -> None:
        m = _multiplier(self._resolved, self.last_step)
        for group in self._groups():
            lr = group["initial_lr"] * m
            # Keep a tensor lr a tensor (fused/capturable optimizers).
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr

    def step(self) -> None:
        """Advance by one optimizer step."""
        self.last_step += 1
        self._apply()

    def get_last_lr(self) -> list[float]:
        """The LR of every param group now."""
        return [float(g["lr"]) for g in self._groups()]

    def _groups(self) -> list[dict[str, Any]]:
        return [g for opt in self.optimizers for g in opt.param_groups]

    def state_dict(self) -> dict[str, Any]:
        """``{"last_step": int}``: the schedule is a pure function of the step."""
        return {"last_step": self.last_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the step and re-apply the LR."""
        self.last_step = int(state["last_step"])
        self._apply()


def plot_schedule(config: LRScheduleConfig, total_steps: int, path: str, base_lr: float = 1.0) -> None:
    """Write a PNG of the schedule over ``total_steps`` (needs matplotlib: ``pip install plait-loop[viz]``)."""
    from plait.loop.tracking.plots import plot_series

    resolved = config.resolve(total_steps)
    steps = list(range(total_steps))
    plot_series(
        steps,
        [base_lr * _multiplier(resolved, s) for s in steps],
        path,
        xlabel="step",
        ylabel="learning rate",
    )
