"""``throughput.timeline``: a profiled window's communication, exposure and idle time, from its events."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from benchmarks.training.throughput import timeline

CUDA, CPU = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU


def _event(name: str, start: float, end: float, device: torch.autograd.DeviceType = CUDA, user: bool = False):
    """A profiler event as torch's ``FunctionEvent`` presents it (microseconds)."""
    return SimpleNamespace(
        name=name, key=name, time_range=SimpleNamespace(start=start, end=end), device_type=device,
        is_user_annotation=user,
    )  # fmt: skip


def test_annotations_on_the_device_are_not_kernels() -> None:
    """Kernels at 0-40 and 60-100 us, an NCCL kernel at 30-50 (10 us of it beside no kernel), inside a
    ``record_function`` region (the optimizer's step, say) and a step annotation that span the whole window:
    the window is 100 us, 10 of them idle; 20 us of communication, 10 exposed."""
    events = [
        _event("gemm", 0, 40),
        _event("ncclDevKernel_AllGather_RING_LL", 30, 50),
        _event("adamw", 60, 100),
        _event("Optimizer.step#AdamW.step", 0, 100, user=True),
        _event("ProfilerStep#7", 0, 100),
        _event("ProfilerStep#7", 0, 120, device=CPU),
        _event("cudaStreamSynchronize", 100, 110, device=CPU),
    ]
    got = timeline(events, s_per_step=1e-4, steps=1)  # 100 us per step: device figures in window units
    assert got["gpu_idle"] == pytest.approx(0.1)
    assert got["comm_ms"] == pytest.approx(0.02)
    assert got["exposed_comm_ms"] == pytest.approx(0.01)
    assert got["host_ms"] == pytest.approx(0.11)
