"""Experiment tracking, throughput/MFU and memory statistics."""

from plait.loop.tracking.plots import plot_loss_curve, plot_series
from plait.loop.tracking.reporter import RunReporter
from plait.loop.tracking.summary import RunSummary, RunSummaryCollector, RunTotals
from plait.loop.tracking.throughput import (
    Interval,
    ThroughputMeter,
    compiled_graphs,
    device_memory_stats,
    measure_matmul_flops,
    peak_flops_for,
)
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
    "Interval",
    "JSONLTracker",
    "RunReporter",
    "RunSummary",
    "RunSummaryCollector",
    "RunTotals",
    "TensorBoardTracker",
    "ThroughputMeter",
    "Tracker",
    "WandbTracker",
    "build_tracker",
    "compiled_graphs",
    "device_memory_stats",
    "measure_matmul_flops",
    "peak_flops_for",
    "plot_loss_curve",
    "plot_series",
    "register_tracker",
]
