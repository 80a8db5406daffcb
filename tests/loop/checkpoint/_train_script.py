"""A tiny training run that checkpoints every step; the SIGKILL/SIGTERM tests drive it as a subprocess.

Usage: python _train_script.py ROOT STEPS ASYNC_MODE [--resume]. Prints ``step N loss L`` after each
step and ``saved N`` once checkpoint N is finalised.
"""

from __future__ import annotations

import sys

import torch
from plait.loop.checkpoint import (
    Checkpointer,
    ModelState,
    OptimizerState,
    PreemptionHandler,
    RngState,
    ValueState,
)
from torch import nn


def build(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def main() -> None:
    root, steps, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    model, opt = build()
    step = ValueState(0)
    state = {"model": ModelState(model), "optim": OptimizerState(model, opt), "rng": RngState(), "step": step}
    ck = Checkpointer(root, keep_last=2, async_mode=mode)  # type: ignore[arg-type]
    if "--resume" in sys.argv and (latest := ck.latest()) is not None:
        ck.load(latest, state)
    handler = PreemptionHandler(grace_period_s=30)
    while step.value < steps:
        x = torch.randn(32, 64)
        loss = (model(x) - x).pow(2).mean()
        loss.backward()
        ck.wait_for_staging()
        opt.step()
        opt.zero_grad()
        step.value += 1
        print(f"step {step.value} loss {loss.item():.8f}", flush=True)
        if handler.should_stop():
            ck.save(step.value, state, blocking=True)
            print(f"saved {step.value}", flush=True)
            print("preempted", flush=True)
            return
        done = ck.finalize()
        if done is not None:
            print(f"saved {done.name}", flush=True)
        ck.save(step.value, state)
    ck.close()
    print("finished", flush=True)


if __name__ == "__main__":
    main()
