"""Throughput, MFU and device memory statistics."""

from __future__ import annotations

import resource
import sys
import time

import torch

__all__ = ["ThroughputMeter", "device_memory_stats", "peak_flops_for"]

# Dense bf16 tensor-core peak FLOP/s per device (vendor data sheets).
_PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12, "B200": 2250e12}


def peak_flops_for(device: torch.device) -> float | None:
    """The bf16 peak of a known CUDA device, else None (pass ``logging.peak_flops`` then)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, flops in _PEAK_BF16.items():
        if key in name:
            # PCIe H100s are slower than SXM.
            return 756e12 if key == "H100" and "PCIe" in name else flops
    return None


class ThroughputMeter:
    """Tokens per second and MFU over the steps since the last :meth:`measure`."""

    def __init__(self, flops_per_token: float | None, peak_flops: float | None, world_size: int) -> None:
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops
        self.world_size = world_size
        self._t = time.perf_counter()
        self._tokens = 0

    def add(self, global_tokens: int) -> None:
        """Count a step's tokens (over all data-parallel ranks)."""
        self._tokens += global_tokens

    def exclude(self, seconds: float) -> None:
        """Leave ``seconds`` of the current interval out of the rate (e.g. time spent evaluating)."""
        self._t += seconds

    def measure(self) -> dict[str, float]:
        """``tokens_per_s`` (global), ``tokens_per_s_per_device`` and ``mfu`` (when FLOPs are known); resets."""
        now = time.perf_counter()
        dt = max(now - self._t, 1e-9)
        tps = self._tokens / dt
        out = {"tokens_per_s": tps, "tokens_per_s_per_device": tps / self.world_size}
        if self.flops_per_token and self.peak_flops:
            out["mfu"] = self.flops_per_token * tps / (self.peak_flops * self.world_size)
        self._t, self._tokens = now, 0
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
