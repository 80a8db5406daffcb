"""Training stall per checkpoint save, async vs synchronous, and DCP planning time first vs later save.

    python -m benchmarks.checkpoint.async_save --params-b 1.0 --dir /tmp/ckpt_bench

One GPU. A stack of square Linear layers with ``--params-b`` billion fp32 parameters trains with
AdamW; the state saved is model + optimizer (about 12 bytes per parameter). The stall is the extra
wall time of a training step that includes a save, over a step without one (for the async modes:
the ``save`` call plus the wait for the host copy before the optimizer step). Planning time is the
time spent in DCP's planning (local plan + global plan) of each save; with plan caching a later save
whose structure is unchanged sends empty plans and reuses the cached global plan. In ``process`` mode
the planner runs in the background process, so it is timed in ``off`` and ``thread`` mode.

Each async mode runs twice: without and with ``Checkpointer.reserve`` (the trainer calls it after the
first step), which allocates and pins the staging buffers (and starts the writer process) in a
background thread while training goes on, so the first save only copies. The table reports the
first save's stall next to the later saves', each as a fraction of a synchronous save, the reserve's
own (off the critical path) time, and each save's time from its start to complete on disk. The
writer process is started once per Python process, by the first ``process`` run: the first save of
``process`` (no reserve) includes its start-up in its time to complete.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from plait.loop.checkpoint import Checkpointer, ModelState, OptimizerState
from torch import nn
from torch.distributed.checkpoint import DefaultSavePlanner

PLAN_TIMES: list[float] = []
PLAN_BUILT: list[bool] = []


class TimedPlanner(DefaultSavePlanner):
    """Times each save's planning and records whether the global plan was built or reused from the cache."""

    def create_local_plan(self):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        out = super().create_local_plan()
        PLAN_TIMES.append(time.perf_counter() - t0)
        PLAN_BUILT.append(False)
        return out

    def _create_global_plan(self, all_plans):  # type: ignore[no-untyped-def]
        PLAN_BUILT[-1] = True
        return super()._create_global_plan(all_plans)

    def create_global_plan(self, all_plans):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        out = super().create_global_plan(all_plans)
        PLAN_TIMES[-1] += time.perf_counter() - t0
        return out


# DCP caches plans per planner class: one class per mode keeps the modes independent. Module-level
# classes, because "process" mode pickles the planner to its background process (where it then runs).
class OffPlanner(TimedPlanner):
    pass


class ThreadPlanner(TimedPlanner):
    pass


class ProcessPlanner(TimedPlanner):
    pass


class ThreadReservePlanner(TimedPlanner):
    pass


class ProcessReservePlanner(TimedPlanner):
    pass


PLANNERS = {
    ("off", False): OffPlanner,
    ("thread", False): ThreadPlanner,
    ("process", False): ProcessPlanner,
    ("thread", True): ThreadReservePlanner,
    ("process", True): ProcessReservePlanner,
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--params-b", type=float, default=1.0)
    ap.add_argument("--width", type=int, default=8192)
    ap.add_argument("--dir", default="/tmp/plait_ckpt_bench")
    ap.add_argument("--saves", type=int, default=4)
    ap.add_argument("--batch", type=int, default=256, help="rows per step (sets the step time)")
    ap.add_argument("--modes", default="off,thread,process")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of the script")
    args = ap.parse_args()
    # A one-rank process group, as in a real run: "process" mode needs one (without it, it writes from a thread).
    # env:// as under torchrun: the writer process joins this store instead of opening its own.
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", init_method="env://", rank=0, world_size=1)
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    n_layers = max(1, round(args.params_b * 1e9 / (args.width * args.width)))
    model = nn.Sequential(*[nn.Linear(args.width, args.width, bias=False) for _ in range(n_layers)]).to(dev)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=dev.type == "cuda")
    x = torch.randn(args.batch, args.width, device=dev)

    def step(ck: Checkpointer | None = None) -> None:
        model(x).float().pow(2).mean().backward()
        if ck is not None:
            ck.wait_for_staging()  # the optimizer must not change tensors still being copied out
        opt.step()
        opt.zero_grad(set_to_none=False)
        sync()

    def timed(fn) -> float:  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - t0

    for _ in range(3):
        step()
    base = statistics.median(timed(step) for _ in range(5))
    state = {"model": ModelState(model), "optim": OptimizerState(model, opt)}
    runs = [("off", False)] + [(m, r) for m in args.modes.split(",") if m != "off" for r in (False, True)]
    results, failed = {}, {}
    for mode, reserve in runs:
        name = f"{mode}{' + reserve' if reserve else ''}"
        root = Path(args.dir) / mode
        shutil.rmtree(root, ignore_errors=True)
        PLAN_TIMES.clear()
        PLAN_BUILT.clear()
        stalls, totals, reserve_s = [], [], None
        try:
            ck = Checkpointer(root, keep_last=1, async_mode=mode)  # type: ignore[arg-type]
            ck._planner = PLANNERS[mode, reserve](enable_plan_caching=True)
            if reserve:
                t0 = time.perf_counter()
                ck.reserve(state)
                while ck.staging is not None and ck.staging.reserving:
                    step()  # training continues while the buffers are allocated
                reserve_s = time.perf_counter() - t0
            for i in range(args.saves):
                t0 = time.perf_counter()
                ck.save(i + 1, state)
                step(ck)
                stalls.append(time.perf_counter() - t0 - base)
                while ck._pending is not None and not _done(ck._pending.response):
                    step(ck)  # training continues while the write runs
                ck.finalize()
                totals.append(time.perf_counter() - t0)
            ck.close()
        except Exception as e:  # report and go on with the other modes
            failed[name] = f"{type(e).__name__}: {e}"
            continue
        finally:
            shutil.rmtree(root, ignore_errors=True)
        plans = [f"{t * 1e3:.1f} ({'built' if b else 'cached'})" for t, b in zip(PLAN_TIMES, PLAN_BUILT)]
        results[name] = (stalls, plans, totals, reserve_s)
    sync_stall = statistics.median(results["off"][0][1:])
    print(
        f"device: {torch.cuda.get_device_name() if dev.type == 'cuda' else 'cpu'}  torch {torch.__version__}  params: {n_params / 1e9:.2f} B "
        f"(fp32 + AdamW: {n_params * 12 / 2**30:.1f} GiB saved)  step: {base * 1e3:.1f} ms  sync save: {sync_stall:.3f} s"
    )
    print(
        "| mode | reserve, off the critical path (s) | first-save stall (s) | first / sync save | "
        "median stall later saves (s) | later / sync save | save start to complete, each save (s) | "
        "planning per save, ms (global plan) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, (stalls, plans, totals, reserve_s) in results.items():
        later = statistics.median(stalls[1:])
        print(
            f"| {name} | {'-' if reserve_s is None else f'{reserve_s:.2f}'} | {stalls[0]:.3f} | "
            f"{stalls[0] / sync_stall:.1%} | {later:.3f} | {later / sync_stall:.1%} | "
            f"{', '.join(f'{t:.2f}' for t in totals)} | {', '.join(plans) or 'in background process'} |"
        )
    for name, err in failed.items():
        print(f"| {name} | failed: {err} | | | | | | |")


def _done(response) -> bool:  # type: ignore[no-untyped-def]
    return response is None or getattr(response, "upload_completion", response).done()


if __name__ == "__main__":
    main()
