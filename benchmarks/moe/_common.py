"""Shared helpers of the MoE benchmarks (timing, environment, imports from a source checkout)."""

from __future__ import annotations

import datetime
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch


def ensure_plait_importable() -> None:
    """Make ``plait.*`` importable from a plain source checkout (no install)."""
    try:
        import plait.moe  # noqa: F401
    except ImportError:
        root = Path(__file__).resolve().parents[2]
        for src in sorted((root / "packages").glob("*/src")):
            sys.path.insert(0, str(src))


def cuda_time_ms(fn: Callable[[], object], warmup: int, iters: int) -> float:
    """Mean milliseconds per call, CUDA events around ``iters`` calls after ``warmup`` (CPU: wall clock)."""
    for _ in range(warmup):
        fn()
    if not torch.cuda.is_available():  # --smoke runs on CPU
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) * 1e3 / iters
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def bf16_matmul_tflops(n: int = 8192, iters: int = 20) -> float:
    """Measured dense bf16 matmul rate of this GPU (the compute ceiling)."""
    if not torch.cuda.is_available():
        return float("nan")
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = cuda_time_ms(lambda: a @ b, 3, iters)
    return 2 * n**3 / (ms * 1e-3) / 1e12


def environment() -> dict[str, str]:
    """Device and library versions for the results file."""
    env = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (smoke run)",
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = "not installed"
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        env["transformers"] = "not installed"
    return env


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)
