"""Shared helpers of the MoE benchmarks (timing, environment, tables)."""

from __future__ import annotations

import argparse
import datetime
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


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


def layer_flops(tokens: int, topk: int, hidden: int, ffn: int, experts: int) -> int:
    """FLOPs of a MoE layer's forward + backward (2x forward): experts' three matmuls and the router."""
    return 3 * (6 * tokens * topk * hidden * ffn + 2 * tokens * hidden * experts)


def timing_rows(
    results: list[tuple[str, float, float]], flops: float, peak: float, tokens: int, base_ms: float | None
) -> list[list[str]]:
    """Table rows of ``(name, ms, peak GiB)`` results: ms, Mtok/s (``tokens`` per step), TFLOP/s, share
    of the bf16 matmul ``peak``, speed against ``base_ms`` ("-" without one) and memory."""
    rows = []
    for name, ms, mem in results:
        tflops = flops / (ms * 1e-3) / 1e12
        vs = f"{base_ms / ms:.2f}x" if base_ms else "-"
        rows.append([name, f"{ms:.2f}", f"{tokens / (ms * 1e-3) / 1e6:.2f}", f"{tflops:.0f}", f"{tflops / peak:.0%}", vs, f"{mem:.1f}"])  # fmt: skip
    return rows


def ep_parser(doc: str, *, tokens: int, hidden: int, experts: int, ffn: int) -> argparse.ArgumentParser:
    """The arguments every expert-parallel benchmark takes (shapes per rank, timing, output, ``--smoke``)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=tokens, help="tokens per rank")
    p.add_argument("--hidden", type=int, default=hidden)
    p.add_argument("--experts", type=int, default=experts)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--ffn", type=int, default=ffn)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--markdown", type=Path, default=None)
    p.add_argument("--smoke", action="store_true", help="tiny shapes, CPU + gloo: checks the script runs")
    return p


@dataclass
class EPBench:
    """One expert-parallel benchmark run under torchrun: process group, ``ep`` mesh over all ranks,
    this rank's tokens and output gradient, and the timing of a MoE layer's forward + backward."""

    args: argparse.Namespace
    dev: torch.device
    dtype: torch.dtype
    rank: int
    world: int
    mesh: Any
    x: torch.Tensor
    dy: torch.Tensor

    @classmethod
    def start(cls, args: argparse.Namespace) -> EPBench:
        """Initialise NCCL (gloo and tiny fp32 shapes with ``--smoke``) and draw each rank's own tokens."""
        from torch.distributed.device_mesh import init_device_mesh

        local_rank = int(os.environ["LOCAL_RANK"])
        if args.smoke:
            args.tokens, args.hidden, args.experts, args.topk, args.ffn = 64, 32, 8, 2, 16
            args.warmup, args.iters = 1, 2
            dist.init_process_group("gloo")
            dev, dtype = torch.device("cpu"), torch.float32
        else:
            torch.cuda.set_device(local_rank)
            dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
            dev, dtype = torch.device("cuda", local_rank), torch.bfloat16
        rank, world = dist.get_rank(), dist.get_world_size()
        mesh = init_device_mesh(dev.type, (world,), mesh_dim_names=("ep",))
        g = torch.Generator(device=dev).manual_seed(1 + rank)  # different tokens per rank
        x = torch.randn(args.tokens, args.hidden, device=dev, dtype=dtype, generator=g).requires_grad_()
        dy = torch.randn(args.tokens, args.hidden, device=dev, dtype=dtype, generator=g)
        return cls(args, dev, dtype, rank, world, mesh, x, dy)

    def make_layer(self) -> Any:
        """A ``plait.moe.MoELayer`` with the same weights on every rank (and in every call)."""
        from plait.moe import MoELayer, RouterConfig

        a = self.args
        torch.manual_seed(0)
        layer = MoELayer(a.hidden, a.ffn, a.experts, RouterConfig(top_k=a.topk, norm_topk_prob=True))
        return layer.to(self.dev, self.dtype)

    def step(self, layer: Any) -> None:
        """Forward + backward of this rank's tokens (gradients reset first)."""
        self.x.grad = None
        for q in layer.parameters():
            q.grad = None
        layer(self.x).hidden_states.backward(self.dy)

    def time(self, layer: Any) -> tuple[float, float]:
        """(ms per step of the slowest rank, this rank's peak GiB) of :meth:`step`."""
        if self.dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        dist.barrier()
        ms = cuda_time_ms(lambda: self.step(layer), self.args.warmup, self.args.iters)
        mem = torch.cuda.max_memory_allocated() / 2**30 if self.dev.type == "cuda" else float("nan")
        ms_t = torch.tensor([ms], device=self.dev)
        dist.all_reduce(ms_t, op=dist.ReduceOp.MAX)
        return ms_t.item(), mem

    def finish(self, text: str) -> None:
        """Print ``text`` and write it to ``--markdown`` (rank 0), then end the process group."""
        if self.rank == 0:
            print(text)
            if self.args.markdown is not None:
                self.args.markdown.parent.mkdir(parents=True, exist_ok=True)
                self.args.markdown.write_text(text)
        dist.destroy_process_group()
