"""Checkpoints of FSDP2-sharded training on gloo: resume on another data-parallel layout."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from plait.dist_core.testing import run_distributed
from plait.loop.checkpoint import Checkpointer, ModelState, OptimizerState, RngState, ValueState
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

GLOBAL_BATCH = 8
SCRIPT = Path(__file__).with_name("_process_mode_script.py")


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 24), nn.Tanh(), nn.Linear(24, 24), nn.Tanh(), nn.Linear(24, 3))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp_shard",))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _step(model, opt, step: int) -> float:
    """One step on this rank's slice of a global batch that depends only on the step number."""
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(GLOBAL_BATCH, 6, generator=g), torch.randn(GLOBAL_BATCH, 3, generator=g)
    world, rank = dist.get_world_size(), dist.get_rank()
    per = GLOBAL_BATCH // world
    loss = (model(x[rank * per : (rank + 1) * per]) - y[rank * per : (rank + 1) * per]).pow(2).mean()
    loss.backward()  # FSDP averages gradients over dp ranks: the gradient of the global mean
    opt.step()
    opt.zero_grad()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item() / world


def _state(model, opt, step):
    return {
        "model": ModelState(model),
        "optim": OptimizerState(model, opt),
        "rng": RngState(),
        "step": ValueState(step),
    }


def _full(model, opt) -> list[torch.Tensor]:
    """Every parameter and AdamW moment, gathered whole (a collective)."""
    out = []
    for p in model.parameters():
        out += [t.full_tensor() for t in (p.detach(), opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"])]
    return out


def _train_and_save(root: str, save_at: int, total: int, mode: str = "thread") -> list[float]:
    losses, _ = _train_save_snapshot(root, save_at, total, mode)
    return losses


def _train_save_snapshot(root: str, save_at: int, total: int, mode: str) -> tuple[list[float], list[torch.Tensor]]:
    """Train ``total`` steps, saving after ``save_at``; returns the losses and the state at the save."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ck = Checkpointer(root, async_mode=mode, process_group=dist.new_group(backend="gloo"))
    losses, saved = [], []
    for step in range(1, total + 1):
        ck.wait_for_staging()
        losses.append(_step(model, opt, step))
        ck.step_done(lambda: _state(model, opt, step))  # reserves the buffers, finalises finished saves
        if step == save_at:
            saved = _full(model, opt)
            ck.save(step, _state(model, opt, step))
    ck.close()
    return losses, saved


def _resume(root: str, total: int) -> list[float]:
    return _resume_snapshot(root, total)[0]


def _resume_snapshot(root: str, total: int) -> tuple[list[float], list[torch.Tensor]]:
    """Load the newest checkpoint into a scrambled model; returns the remaining losses and the loaded state."""
    model = _model()
    torch.manual_seed(99)
    for p in model.parameters():  # scramble: all state must come from the checkpoint
        p.data.normal_()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ck = Checkpointer(root, async_mode="off")
    state = _state(model, opt, 0)
    ck.load(ck.latest(), state)
    loaded = _full(model, opt)
    return [_step(model, opt, step) for step in range(state["step"].value + 1, total + 1)], loaded


def test_fsdp4_checkpoint_resumes_on_fsdp2_and_fsdp4(tmp_path):
    reference = run_distributed(_train_and_save, 4, str(tmp_path), 3, 6, timeout=400)[0]
    same_layout = run_distributed(_resume, 4, str(tmp_path), 6, timeout=400)[0]
    assert same_layout == reference[3:]  # bit for bit on the same layout
    resharded = run_distributed(_resume, 2, str(tmp_path), 6, timeout=400)[0]
    torch.testing.assert_close(resharded, reference[3:], rtol=1e-5, atol=1e-6)


def test_checkpointers_in_the_same_processes_do_not_share_cached_plans(tmp_path):
    """DCP caches save plans process-wide by the planner's class name: a 2-rank save followed by a 4-rank
    save on the same (pooled) processes planned the second with the first's chunks and failed ("invalid
    fill"). Each Checkpointer now has its own cache key."""
    run_distributed(_train_and_save, 2, str(tmp_path / "two"), 1, 1, timeout=400)
    reference = run_distributed(_train_and_save, 4, str(tmp_path / "four"), 1, 2, timeout=400)[0]
    assert run_distributed(_resume, 4, str(tmp_path / "four"), 2, timeout=400)[0] == reference[1:]


def _torchrun(*args: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]


def test_process_mode_saves_and_resumes_exactly_on_two_ranks(tmp_path):
    """The default async mode on 2 gloo ranks (torchrun): DCP's writer processes, joining the job's
    store, write the checkpoint; a new job loads it into a scrambled model and continues bit for bit."""
    root = tmp_path / "ckpt"
    _torchrun("train", str(root), str(tmp_path / "train.pt"))
    assert [p.name for p in root.iterdir()] == ["step_00000003"]
    _torchrun("resume", str(root), str(tmp_path / "resume.pt"))
    losses, saved = torch.load(tmp_path / "train.pt")
    resumed, loaded = torch.load(tmp_path / "resume.pt")
    assert len(saved) == len(loaded) == 18  # 3 layers x (weight, bias) x (param, exp_avg, exp_avg_sq)
    for got, want in zip(loaded, saved, strict=True):
        assert torch.equal(got, want)
    assert resumed == losses[3:]
