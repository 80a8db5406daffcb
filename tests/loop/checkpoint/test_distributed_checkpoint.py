"""Checkpoints of FSDP2-sharded training on gloo: resume on another data-parallel layout."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from plait.dist_core.testing import run_distributed
from plait.loop.checkpoint import (
    CachingSavePlanner,
    Checkpointer,
    ModelState,
    OptimizerState,
    RngState,
    ValueState,
)
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

GLOBAL_BATCH = 8
REPO = Path(__file__).resolve().parents[3]


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


def _train_save_snapshot(
    root: str, save_at: int, total: int, mode: str
) -> tuple[list[float], list[torch.Tensor]]:
    """Train ``total`` steps, saving after ``save_at``; returns the losses and the state at the save."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ck = Checkpointer(root, async_mode=mode, process_group=dist.new_group(backend="gloo"))
    losses, saved = [], []
    for step in range(1, total + 1):
        ck.wait_for_staging()
        losses.append(_step(model, opt, step))
        ck.step_done(lambda step=step: _state(model, opt, step))  # reserves the buffers, finalises saves
        if step == save_at:
            saved = _full(model, opt)
            ck.save(step, _state(model, opt, step))
    writer = _dcp_writer_process()
    ck.close()
    if mode == "process":  # the last process-mode Checkpointer stops DCP's writer process on close
        assert writer is not None and not writer._save_process.is_alive() and _dcp_writer_process() is None
    return losses, saved


def _dcp_writer_process() -> Any:
    from torch.distributed.checkpoint import _async_process_executor as ape

    return ape._CHECKPOINT_PROCESS


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
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "tests.loop.checkpoint._process_mode_script",
            *args,
        ],
        cwd=REPO,
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
    record = tmp_path / "planning.txt"
    _torchrun("resume", str(root), str(tmp_path / "resume.pt"), str(record))
    losses, saved = torch.load(tmp_path / "train.pt")
    resumed, loaded = torch.load(tmp_path / "resume.pt")
    assert len(saved) == len(loaded) == 18  # 3 layers x (weight, bias) x (param, exp_avg, exp_avg_sq)
    for got, want in zip(loaded, saved, strict=True):
        assert torch.equal(got, want)
    assert resumed == losses[3:]

    # Restarted process-mode checkpointers (the same job, after the resume above): the plan saved with
    # step 3 is reused by the writer process; a new entry makes it plan again.
    assert record.read_text() == "RP"


class _CountingPlanner(CachingSavePlanner):
    """Records, for each global planning DCP asks the coordinator for, whether any rank sent a plan
    (False: every rank's plan equalled its cached one and the cached global plan was reused)."""

    def __init__(self) -> None:
        super().__init__()
        self.planned: list[bool] = []

    def create_global_plan(self, all_plans):
        self.planned.append(any(plan.usable for plan in all_plans))
        return super().create_global_plan(all_plans)


class _FileCountingPlanner(CachingSavePlanner):
    """Appends ``P`` (a rank sent a plan: global planning) or ``R`` (the cached plan reused) to file
    ``record`` for each global planning: it runs in DCP's writer process in ``async_mode="process"``."""

    def __init__(self, record: str) -> None:
        super().__init__()
        self.record = record

    def create_global_plan(self, all_plans):
        with open(self.record, "a") as f:
            f.write("P" if any(plan.usable for plan in all_plans) else "R")
        return super().create_global_plan(all_plans)


def _resave(root: str, record: str, extra: bool) -> None:
    """A restarted job (process mode): resume, one step, save (with a new entry if ``extra``)."""
    ck = Checkpointer(root, async_mode="process", save_planner=_FileCountingPlanner(record))
    model, opt = _fresh()
    state = _state(model, opt, 0)
    assert ck.resume(state) is not None
    step = state["step"].value + 1
    _step(model, opt, step)
    ck.save(step, _state(model, opt, step) | ({"extra": ValueState(torch.arange(5.0))} if extra else {}))
    ck.close()


def _fresh() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = _model()
    torch.manual_seed(99)
    for p in model.parameters():  # scramble: all state must come from the checkpoint
        p.data.normal_()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _restarted(root: str, step: int | None = None, extra: bool = False, strict: bool = True) -> tuple:
    """A new Checkpointer (as after a restart) and a new model, loaded from ``step`` (default: the newest)."""
    planner = _CountingPlanner()
    ck = Checkpointer(
        root, async_mode="thread", process_group=dist.new_group(backend="gloo"), save_planner=planner
    )
    model, opt = _fresh()
    state = _state(model, opt, 0) | ({"extra": ValueState(torch.zeros(5))} if extra else {})
    ck.load(Path(root) / f"step_{step:08d}" if step else ck.latest(), state, strict=strict)
    return ck, planner, model, opt, state


def _plan_reuse(root: str) -> tuple[list[list[bool]], list[bool]]:
    model, opt = _model(), None
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    first = _CountingPlanner()
    ck = Checkpointer(
        root, async_mode="thread", process_group=dist.new_group(backend="gloo"), save_planner=first
    )
    for step in (1, 2):
        _step(model, opt, step)
        ck.save(step, _state(model, opt, step))
        ck.finalize()
    ck.close()  # drops its cached plans, as a restart does

    # Restart, same structure: the first save reuses the plan saved with step 2.
    ck, second, model, opt, _ = _restarted(root)
    _step(model, opt, 3)
    ck.save(3, _state(model, opt, 3))
    ck.close()
    exact = [_same(_full(model, opt), _reloaded(root, 3)[0])]

    # Restart, changed structure (a new entry): the first save plans again, and the checkpoint is right.
    ck, third, model, opt, _ = _restarted(root)
    ck.save(4, _state(model, opt, 4) | {"extra": ValueState(torch.arange(5.0))})
    ck.close()
    full4, extra4 = _reloaded(root, 4, extra=True)
    exact.append(_same(_full(model, opt), full4) and torch.equal(extra4, torch.arange(5.0)))

    # Step 3's plan files (which fit the state below but not step 4's metadata) in step 4: plan again.
    if dist.get_rank() == 0:
        for rank in (0, 1):
            name = f"plan.rank{rank}.pt"
            (Path(root) / "step_00000004" / name).write_bytes(
                (Path(root) / "step_00000003" / name).read_bytes()
            )
    dist.barrier()
    ck, stale, model, opt, _ = _restarted(root, 4, strict=False)  # without "extra": step 3's structure
    ck.save(5, _state(model, opt, 5))
    ck.close()
    exact.append(_same(_full(model, opt), _reloaded(root, 5)[0]))

    # The coordinator's plan file unreadable, the other rank's fine: every rank plans again.
    if dist.get_rank() == 0:
        (Path(root) / "step_00000005" / "plan.rank0.pt").write_bytes(b"not a plan")
    dist.barrier()
    ck, unreadable, model, opt, _ = _restarted(root, 5)
    ck.save(6, _state(model, opt, 6))
    ck.close()
    exact.append(_same(_full(model, opt), _reloaded(root, 6)[0]))
    return [first.planned, second.planned, third.planned, stale.planned, unreadable.planned], exact


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _reloaded(root: str, step: int, extra: bool = False) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Every parameter and moment of checkpoint ``step`` loaded into a new model (and its "extra" entry)."""
    ck = Checkpointer(root, async_mode="off")
    model, opt = _fresh()
    state = _state(model, opt, 0)
    new = ValueState(torch.zeros(5))
    ck.load(Path(root) / f"step_{step:08d}", state | ({"extra": new} if extra else {}))
    ck.close()
    return _full(model, opt), new.value


def test_the_save_plan_is_reused_after_a_restart_while_the_structure_is_unchanged(tmp_path):
    """Megatron-style plan reuse: the cached global plan is saved with each checkpoint and, after a restart,
    reused when it matches the checkpoint's metadata and the state's structure; otherwise DCP plans again."""
    results = run_distributed(_plan_reuse, 2, str(tmp_path), timeout=400)
    assert results[0][0] == [[True, False], [False], [True], [True], [True]]  # rank 0 coordinates
    assert results[1][0] == [[], [], [], [], []]
    assert all(all(exact) for _, exact in results)
