"""Checkpoints of FSDP2-sharded training on gloo: resume on another data-parallel layout."""

from __future__ import annotations

import torch
import torch.distributed as dist
from plait.dist_core.testing import run_distributed
from plait.loop.checkpoint import Checkpointer, ModelState, OptimizerState, RngState, ValueState
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

GLOBAL_BATCH = 8


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


def _train_and_save(root: str, save_at: int, total: int) -> list[float]:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ck = Checkpointer(root, async_mode="thread", process_group=dist.new_group(backend="gloo"))
    losses = []
    for step in range(1, total + 1):
        ck.wait_for_staging()
        losses.append(_step(model, opt, step))
        if step == save_at:
            ck.save(step, _state(model, opt, step))
    ck.close()
    return losses


def _resume(root: str, total: int) -> list[float]:
    model = _model()
    torch.manual_seed(99)
    for p in model.parameters():  # scramble: all state must come from the checkpoint
        p.data.normal_()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ck = Checkpointer(root, async_mode="off")
    state = _state(model, opt, 0)
    ck.load(ck.latest(), state)
    return [_step(model, opt, step) for step in range(state["step"].value + 1, total + 1)]


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
