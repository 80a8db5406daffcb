"""Throughput, MFU and device memory statistics."""

from __future__ import annotations

import resource
import sys
import time
from dataclasses import dataclass

import torch

__all__ = [
    "Interval",
    "ThroughputMeter",
    "compiled_graphs",
    "device_memory_stats",
    "measure_matmul_flops",
    "peak_flops_for",
]

# Dense bf16 tensor-core peak FLOP/s per device (vendor data sheets).
_PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12, "B200": 2250e12}


def peak_flops_for(device: torch.device) -> float | None:
    """The bf16 peak of a known CUDA device, else None (pass ``logging.peak_flops`` then).

    On CPU the trainer measures a peak instead (:func:`measure_matmul_flops`).
    """
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, flops in _PEAK_BF16.items():
        if key in name:
            # PCIe H100s are slower than SXM.
            return 756e12 if key == "H100" and "PCIe" in name else flops
    return None


def measure_matmul_flops(device: torch.device, size: int = 1024, trials: int = 4) -> float:
    """The float32 matmul rate (FLOP/s) this process reaches on ``device``: the best of ``trials`` timed
    pairs of ``size``-square matmuls, measured now (~0.1-0.3 s on a CPU).

    On CPU it stands in for a data-sheet peak, so that MFU is the fraction of what this process's
    threads can do at all (the best trial, so that a moment of contention weighs less).
    """
    a = torch.randn(size, size, device=device)
    b = torch.randn(size, size, device=device)
    torch.mm(a, b)  # warm-up (thread pool, allocator)
    best = 0.0
    for _ in range(trials):
        t0 = time.perf_counter()
        torch.mm(a, b)
        torch.mm(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = max(best, 2 * 2 * size**3 / max(time.perf_counter() - t0, 1e-9))
    return best


def compiled_graphs() -> int:
    """How many graphs torch.compile (dynamo) has compiled in this process so far."""
    from torch._dynamo.utils import counters  # the one private torch API of this module

    return int(counters["stats"]["unique_graphs"])


@dataclass(frozen=True)
class Interval:
    """One logging interval of a :class:`ThroughputMeter`: its tokens, seconds and whether it compiled."""

    tokens: int
    seconds: float
    compiled: bool


class ThroughputMeter:
    """Tokens per second and MFU over the steps since the last :meth:`measure`.

    Each :meth:`measure` also records the interval in :attr:`last_interval` (tokens, seconds, and
    whether torch.compile compiled a graph during it), which the run summary uses for its
    steady-state figures.
    """

    def __init__(self, flops_per_token: float | None, peak_flops: float | None, world_size: int) -> None:
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops
        self.world_size = world_size
        self.last_interval: Interval | None = None
        self._t = time.perf_counter()
        self._tokens = 0
        self._data_wait = 0.0
        self._graphs = compiled_graphs()

    def add(self, global_tokens: int) -> None:
        """Count a step's tokens (over all data-parallel ranks)."""
        self._tokens += global_tokens

    def add_data_wait(self, seconds: float) -> None:
        """Count time the step loop waited for its next batch (reported as ``data_wait_frac``)."""
        self._data_wait += seconds

    def exclude(self, seconds: float) -> None:
        """Leave ``seconds`` of the current interval out of the rate (e.g. time spent evaluating).

        Graphs compiled until now (e.g. by the evaluation) do not mark the interval as compiled.
        """
        self._t += seconds
        self._graphs = compiled_graphs()

    def mfu(self, tokens_per_s: float) -> float | None:
        """The model FLOPs utilisation of a global rate (over ``world_size`` devices); None when the
        model's FLOPs per token or the device peak are unknown."""
        if self.flops_per_token and self.peak_flops:
            return self.flops_per_token * tokens_per_s / (self.peak_flops * self.world_size)
        return None

    def measure(self) -> dict[str, float]:
        """``tokens_per_s`` (global), ``tokens_per_s_per_device``, ``data_wait_frac`` (the fraction of the
        interval spent waiting for batches) and ``mfu`` (when FLOPs are known); resets."""
        now = time.perf_counter()
        dt = max(now - self._t, 1e-9)
        tps = self._tokens / dt
        out = {"tokens_per_s": tps, "tokens_per_s_per_device": tps / self.world_size}
        out["data_wait_frac"] = self._data_wait / dt
        mfu = self.mfu(tps)
        if mfu is not None:
            out["mfu"] = mfu
        graphs = compiled_graphs()
        self.last_interval = Interval(self._tokens, dt, graphs != self._graphs)
        self._t, self._tokens, self._graphs, self._data_wait = now, 0, graphs, 0.0
        return out


def device_memory_stats(device: torch.device) -> dict[str, float]:
    """Peak allocated/reserved GiB since the last call on CUDA (peaks reset); peak RSS GiB on CPU."""
    if device.type == "cuda":
        gib = 1024**3
        out = {
            "mem_allocated_gib": torch.cuda.max_memory_allocated(device) / gib,
            "mem_reserved_gib": torch.cuda.max_memory_reserved(device) / gib,
        }
        torch.cuda.reset_peak_memory_stats(device)
        return out
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"max_rss_gib": rss / (1024**3 if sys.platform == "darwin" else 1024**2)}
