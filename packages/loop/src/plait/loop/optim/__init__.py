"""Optimizers and learning-rate schedules."""

from plait.loop.optim.optimizers import build_optimizer, param_groups, wants_no_decay
from plait.loop.optim.schedules import LRScheduleConfig, LRSegment, PiecewiseLR, plot_schedule

__all__ = [
    "LRScheduleConfig",
    "LRSegment",
    "PiecewiseLR",
    "build_optimizer",
    "param_groups",
    "plot_schedule",
    "wants_no_decay",
]
