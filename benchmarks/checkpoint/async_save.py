"""Training stall per checkpoint save, async vs synchronous, and DCP planning time first vs later save.

    python benchmarks/checkpoint/async_save.py --params-b 1.0 --dir /tmp/ckpt_bench

One GPU. A stack of square Linear layers with ``--params-b`` billion fp32 parameters trains with
AdamW; the state saved is model + optimizer (about 12 bytes per parameter). The stall is the extra
wall time of a training step that includes a save, over a step without one. Planning time is the
time spent in DCP's global planning (``create_global_plan``) of each save.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import time
from pathlib import Path

import torch
from plait.loop.checkpoint import Checkpointer, ModelState, OptimizerState
from torch import nn
from torch.distributed.checkpoint import DefaultSavePlanner

PLAN_TIMES: list[float] = []


class TimedPlanner(DefaultSavePlanner):
    def create_global_plan(self, all_plans):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        out = super().create_global_plan(all_plans)
        PLAN_TIMES.append(time.perf_counter() - t0)
        return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--params-b", type=float, default=1.0)
    ap.add_argument("--width", type=int, default=8192)
    ap.add_argument("--dir", default="/tmp/plait_ckpt_bench")
    ap.add_argument("--saves", type=int, default=3)
    args = ap.parse_args()
    dev = torch.device("cuda")
    n_layers = max(1, round(args.params_b * 1e9 / (args.width * args.width)))
    model = nn.Sequential(*[nn.Linear(args.width, args.width, bias=False) for _ in range(n_layers)]).to(dev)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    x = torch.randn(256, args.width, device=dev)

    def step(ck: Checkpointer | None = None) -> None:
        model(x).float().pow(2).mean().backward()
        if ck is not None:
            ck.wait_for_staging()  # the optimizer must not change tensors still being copied out
        opt.step()
        opt.zero_grad(set_to_none=False)
        torch.cuda.synchronize()

    def timed(fn) -> float:  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    for _ in range(3):
        step()
    base = statistics.median(timed(step) for _ in range(5))
    state = {"model": ModelState(model), "optim": OptimizerState(model, opt)}
    results = {}
    for mode in ("off", "process"):
        root = Path(args.dir) / mode
        shutil.rmtree(root, ignore_errors=True)
        ck = Checkpointer(root, keep_last=1, async_mode=mode)  # type: ignore[arg-type]
        ck._planner = TimedPlanner(enable_plan_caching=True)
        PLAN_TIMES.clear()
        stalls, writes = [], []
        for i in range(args.saves):
            t0 = time.perf_counter()
            ck.save(i + 1, state)
            step(ck)
            stalls.append(time.perf_counter() - t0 - base)
            for _ in range(2):  # training continues while the write runs
                step(ck)
            t1 = time.perf_counter()
            ck.finalize()
            writes.append(time.perf_counter() - t0 if mode == "off" else time.perf_counter() - t1)
        ck.close()
        results[mode] = (stalls, list(PLAN_TIMES))
        shutil.rmtree(root, ignore_errors=True)
    sync_stall = statistics.median(results["off"][0][1:])
    print(
        f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  params: {n_params / 1e9:.2f} B "
        f"(fp32 + AdamW: {n_params * 12 / 2**30:.1f} GiB saved)  step: {base * 1e3:.1f} ms"
    )
    print(
        "| mode | stall per save, each save (s) | median stall later saves (s) | stall / sync save | "
        "global planning per save (ms) |"
    )
    print("|---|---|---|---|---|")
    for mode, (stalls, plans) in results.items():
        later = statistics.median(stalls[1:])
        print(
            f"| {mode} | {', '.join(f'{s:.3f}' for s in stalls)} | {later:.3f} | {later / sync_stall:.1%} | "
            f"{', '.join(f'{p * 1e3:.1f}' for p in plans) or 'in background process'} |"
        )


if __name__ == "__main__":
    main()
