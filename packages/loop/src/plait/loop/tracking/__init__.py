"""Experiment tracking, throughput/MFU and memory statistics."""

from plait.loop.tracking.plots import plot_loss_curve, plot_series
from plait.loop.tracking.reporter import RunReporter
from plait.loop.tracking.summary import RunSummary, RunSummaryCollector
from plait.loop.tracking.throughput import ThroughputMeter, device_memory_stats, peak_flops_for
from plait.loop.tracking.trackers import (
    AimTracker,
    ConsoleTracker,
    JSONLTracker,
    TensorBoardTracker,
    Tracker,
    WandbTracker,
    build_tracker,
    register_tracker,
)

__all__ = [
    "AimTracker",
    "ConsoleTracker",
    "JSONLTracker",
    "RunReporter",
    "RunSummary",
    "RunSummaryCollector",
    "TensorBoardTracker",
    "ThroughputMeter",
    "Tracker",
    "WandbTracker",
    "build_tracker",
    "device_memory_stats",
    "peak_flops_for",
    "plot_loss_curve",
    "plot_series",
    "register_tracker",
]
