"""DCP hooks of the Checkpointer: a custom save planner, storage writer and load planner, and the
coordinator rank."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import pytest
import torch
import torch.distributed as dist
from plait.dist_core.testing import run_distributed
from plait.loop.checkpoint import Checkpointer, ModelState, OptimizerState, ValueState
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner, FileSystemWriter

_FINISHED_BY: list[int] = []  # ranks whose storage writer ran finish() (writes DCP's .metadata)


class _RecordingPlanner(DefaultSavePlanner):
    def __init__(self) -> None:
        super().__init__(enable_plan_caching=True)
        self.calls: list[str] = []

    def create_local_plan(self):
        self.calls.append("create_local_plan")
        return super().create_local_plan()

    def create_global_plan(self, all_plans):
        self.calls.append("create_global_plan")
        return super().create_global_plan(all_plans)


class _RecordingLoadPlanner(DefaultLoadPlanner):
    def __init__(self) -> None:
        super().__init__()
        self.planned = 0

    def create_local_plan(self):
        self.planned += 1
        return super().create_local_plan()


class _RecordingWriter(FileSystemWriter):
    paths: ClassVar[list[Path]] = []

    def __init__(self, path: Path) -> None:
        super().__init__(str(path))
        _RecordingWriter.paths.append(path)

    def finish(self, metadata, results) -> None:
        _FINISHED_BY.append(dist.get_rank() if dist.is_initialized() else 0)
        super().finish(metadata, results)


def _state(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> dict:
    return {"model": ModelState(model), "optim": OptimizerState(model, opt), "step": ValueState(step)}


def _trained(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(5, 4)).square().mean().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def _snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    tensors = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        tensors += [opt.state[p]["exp_avg"].clone(), opt.state[p]["exp_avg_sq"].clone()]
    return tensors


@pytest.mark.parametrize("async_mode", ["off", "thread"])
def test_custom_save_planner_writer_and_load_planner_are_used_and_the_checkpoint_resumes(
    tmp_path, async_mode
):
    _FINISHED_BY.clear()
    _RecordingWriter.paths.clear()
    planner, load_planner = _RecordingPlanner(), _RecordingLoadPlanner()
    ck = Checkpointer(
        tmp_path,
        async_mode=async_mode,
        save_planner=planner,
        storage_writer_factory=_RecordingWriter,
        load_planner=load_planner,
    )
    model, opt = _trained(0)
    expected = _snapshot(model, opt)
    ck.save(1, _state(model, opt, 1))
    ck.save(2, _state(model, opt, 2))
    ck.close()
    assert planner.calls == ["create_local_plan", "create_global_plan"] * 2
    assert _RecordingWriter.paths == [
        tmp_path / ".step_00000001.partial",
        tmp_path / ".step_00000002.partial",
    ]
    assert _FINISHED_BY == [0, 0]

    fresh, fresh_opt = _trained(1)  # other weights and moments: all of them must come from the checkpoint
    state = _state(fresh, fresh_opt, 0)
    path, _ = ck.resume(state)
    assert path == tmp_path / "step_00000002" and state["step"].value == 2
    assert load_planner.planned == 1
    for got, want in zip(_snapshot(fresh, fresh_opt), expected, strict=True):
        assert torch.equal(got, want)


def test_coordinator_rank_must_be_in_the_group_and_needs_synchronous_saves(tmp_path):
    with pytest.raises(ValueError, match=r"checkpoint\.coordinator_rank must be in \[0, 1\)"):
        Checkpointer(tmp_path, async_mode="off", coordinator_rank=1)
    with pytest.raises(ValueError, match=r"checkpoint\.coordinator_rank"):
        Checkpointer(tmp_path, async_mode="off", coordinator_rank=-1)


def _save_and_resume_with_coordinator(root: str, coordinator: int) -> tuple[list[int], bool]:
    _FINISHED_BY.clear()
    torch.manual_seed(dist.get_rank())  # each rank holds its own tensor: both ranks write data
    own = {"w": torch.randn(3, 5), "b": torch.randn(7)}
    ck = Checkpointer(
        root, async_mode="off", coordinator_rank=coordinator, storage_writer_factory=_RecordingWriter
    )
    ck.save(1, {f"rank{dist.get_rank()}": ValueState(own)} | {"shared": ValueState(torch.arange(4.0))})
    finished = list(_FINISHED_BY)
    state = {f"rank{dist.get_rank()}": ValueState({"w": torch.zeros(3, 5), "b": torch.zeros(7)})}
    ck.load(ck.latest(), state | {"shared": ValueState(torch.zeros(4))}, strict=False)
    got = state[f"rank{dist.get_rank()}"].value
    ck.close()
    return finished, torch.equal(got["w"], own["w"]) and torch.equal(got["b"], own["b"])


def test_coordinator_rank_1_writes_the_metadata_on_two_gloo_ranks(tmp_path):
    results = run_distributed(_save_and_resume_with_coordinator, 2, str(tmp_path), 1, timeout=300)
    assert [finished for finished, _ in results] == [[], [1]]  # only rank 1 ran the writer's finish()
    assert all(resumed for _, resumed in results)
    assert run_distributed(_bad_coordinator, 2, str(tmp_path / "bad"), timeout=300) == [True, True]


def _bad_coordinator(root: str) -> bool:
    with pytest.raises(ValueError, match=r"checkpoint\.coordinator_rank must be in \[0, 2\)"):
        Checkpointer(root, async_mode="off", coordinator_rank=2)
    with pytest.raises(
        ValueError, match=r"checkpoint\.coordinator_rank=1 needs checkpoint\.async_mode='off'"
    ):
        Checkpointer(root, async_mode="process", coordinator_rank=1)
    return True


def test_the_trainer_passes_the_hooks_and_the_coordinator_rank(tmp_path):
    from tests.loop.checkpoint.test_trainer_checkpointing import _fit, _trainer

    _FINISHED_BY.clear()
    _RecordingWriter.paths.clear()
    planner, load_planner = _RecordingPlanner(), _RecordingLoadPlanner()
    hooks = {
        "save_planner": planner,
        "storage_writer_factory": _RecordingWriter,
        "load_planner": load_planner,
    }
    _fit(_trainer(tmp_path, 3, overrides=("--checkpoint.coordinator_rank=0",), **hooks))  # saves step 3
    assert planner.calls == ["create_local_plan", "create_global_plan"]
    assert _RecordingWriter.paths == [
        tmp_path / "checkpoints" / ".step_00000003.partial"
    ] and _FINISHED_BY == [0]
    resumed = _trainer(tmp_path, 3, **hooks)
    assert load_planner.planned == 0  # construction loads nothing
    resumed.resume()
    assert resumed.step == 3 and load_planner.planned == 1
    resumed.close()
    with pytest.raises(ValueError, match=r"checkpoint\.coordinator_rank must be in \[0, 1\)"):
        _trainer(tmp_path, 3, overrides=("--checkpoint.coordinator_rank=1", "--checkpoint.async_mode=off"))
