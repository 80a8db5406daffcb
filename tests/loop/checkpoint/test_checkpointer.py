"""Checkpointer: exact resume, atomic visibility under SIGKILL, SIGTERM saves, clear mismatch errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from plait.loop.checkpoint import (
    Checkpointer,
    CheckpointMismatchError,
    ModelState,
    OptimizerState,
    RngState,
    ValueState,
)
from torch import nn

from tests.loop.checkpoint._train_script import build

SCRIPT = Path(__file__).with_name("_train_script.py")


def _setup(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return model, opt


def _train(model, opt, n):
    losses = []
    for _ in range(n):
        x = torch.randn(6, 8)  # draws from the global RNG: resume must restore it
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _state(model, opt, step):
    return {
        "model": ModelState(model),
        "optim": OptimizerState(model, opt),
        "rng": RngState(),
        "step": ValueState(step),
    }


@pytest.mark.parametrize("mode", ["off", "thread"])
def test_exact_resume_bitwise(tmp_path, mode):
    model, opt = _setup()
    _train(model, opt, 3)
    ck = Checkpointer(tmp_path, async_mode=mode)
    ck.save(3, _state(model, opt, 3))
    ck.wait_for_staging()
    reference = _train(model, opt, 5)  # training goes on while the save is written
    ck.close()

    model2, opt2 = _setup(seed=123)  # different init: everything must come from the checkpoint
    state = _state(model2, opt2, 0)
    meta = Checkpointer(tmp_path).load(ck.latest(), state)
    assert meta["step"] == 3 and state["step"].value == 3
    assert _train(model2, opt2, 5) == reference  # bit for bit


def test_keep_last_and_latest(tmp_path):
    model, opt = _setup()
    ck = Checkpointer(tmp_path, keep_last=2, async_mode="thread")
    for step in range(1, 5):
        _train(model, opt, 1)
        ck.save(step, _state(model, opt, step))
    ck.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000003", "step_00000004"]
    assert ck.latest() == tmp_path / "step_00000004"


def test_repeated_async_saves_are_exact_and_reuse_staging_buffers(tmp_path):
    """Every save of one Checkpointer holds its own step's values, copied into the same host buffers each
    time (torch 2.11's DefaultStager dropped its buffers after one save and failed the next one)."""
    model, opt = _setup()
    ck = Checkpointer(tmp_path, keep_last=3, async_mode="thread")
    expected = {}
    for step in (1, 2, 3):
        _train(model, opt, 1)
        expected[step] = {k: v.clone() for k, v in model.state_dict().items()}
        ck.save(step, _state(model, opt, step))
        ck.wait_for_staging()
    assert ck.staging is not None and ck.staging.stager is not None
    staged = [ck.staging.stager.stage({"w": model[0].weight}).result()["w"] for _ in range(2)]
    assert staged[0].data_ptr() == staged[1].data_ptr()
    assert torch.equal(staged[1], model[0].weight)
    ck.close()
    for step, want in expected.items():
        fresh, fresh_opt = _setup(seed=step + 100)
        Checkpointer(tmp_path).load(tmp_path / f"step_{step:08d}", _state(fresh, fresh_opt, 0))
        for k, v in fresh.state_dict().items():
            assert torch.equal(v, want[k]), (step, k)


def test_incomplete_checkpoints_are_ignored_and_cleaned(tmp_path):
    model, opt = _setup()
    ck = Checkpointer(tmp_path, async_mode="off")
    ck.save(1, _state(model, opt, 1))
    (tmp_path / ".step_00000002.partial").mkdir()  # an interrupted save
    (tmp_path / "step_00000003").mkdir()  # a step dir without its completion marker
    assert ck.latest() == tmp_path / "step_00000001"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001"]


def test_mismatch_names_keys_and_shapes(tmp_path):
    model, opt = _setup()
    _train(model, opt, 1)
    ck = Checkpointer(tmp_path, async_mode="off")
    ck.save(1, _state(model, opt, 1))
    wider = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))
    with pytest.raises(
        CheckpointMismatchError, match=r"model\.0\.weight: checkpoint shape \(16, 8\) != current \(32, 8\)"
    ):
        ck.load(ck.latest(), {"model": ModelState(wider)})
    deeper = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4), nn.Linear(4, 4))
    with pytest.raises(
        CheckpointMismatchError, match=r"missing in checkpoint: \['model\.3\.bias', 'model\.3\.weight'\]"
    ):
        ck.load(ck.latest(), {"model": ModelState(deeper)})
    with pytest.raises(CheckpointMismatchError, match=r"not in the current state: \[.*optim\."):
        ck.load(ck.latest(), {"model": ModelState(model)})  # strict: the optimizer state is unused
    ck.load(ck.latest(), {"model": ModelState(model)}, strict=False)


def test_corrupted_checkpoint_is_reported(tmp_path):
    model, opt = _setup()
    ck = Checkpointer(tmp_path, async_mode="off")
    ck.save(1, _state(model, opt, 1))
    path = ck.latest()
    (path / ".metadata").write_bytes(b"garbage")
    with pytest.raises(CheckpointMismatchError, match="cannot read checkpoint metadata"):
        ck.load(path, _state(model, opt, 0))
    with pytest.raises(CheckpointMismatchError, match="not a complete plait checkpoint"):
        ck.load(tmp_path, _state(model, opt, 0))


def _run(root, steps, mode, *extra):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), str(root), str(steps), mode, *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _wait_for(proc, prefix, count):
    seen = 0
    for line in proc.stdout:
        if line.startswith(prefix):
            seen += 1
            if seen == count:
                return line
    raise AssertionError(
        f"process ended before {count} lines starting with {prefix!r}: {proc.stderr.read()[-2000:]}"
    )


@pytest.mark.parametrize("delay", [0.0, 0.004, 0.02])
def test_sigkill_during_async_save_leaves_previous_checkpoint(tmp_path, delay):
    """Kill the trainer at different moments inside a save: what is visible is always loadable."""
    proc = _run(tmp_path, 10_000, "thread")
    _wait_for(proc, "saved", 2)
    time.sleep(delay)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    visible = sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("."))
    assert visible, "at least one complete checkpoint must survive"
    for name in visible:
        assert json.loads((tmp_path / name / "plait_checkpoint.json").read_text())["step"] == int(name[5:])
    model, opt = build()
    ck = Checkpointer(tmp_path, async_mode="off")
    ck.load(
        ck.latest(),
        {
            "model": ModelState(model),
            "optim": OptimizerState(model, opt),
            "rng": RngState(),
            "step": ValueState(0),
        },
    )
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir()), "partial saves are cleaned on resume"


def test_sigterm_saves_final_checkpoint_and_resume_continues_the_curve(tmp_path):
    full = _run(tmp_path / "full", 40, "thread")
    out, err = full.communicate(timeout=600)
    assert full.returncode == 0, err
    reference = [ln for ln in out.splitlines() if ln.startswith("step")]

    proc = _run(tmp_path / "run", 10_000, "thread")
    line = _wait_for(proc, "step", 5)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0 and "preempted" in out, err
    stopped = int([ln for ln in out.splitlines() if ln.startswith("saved")][-1].split()[1])
    assert int(line.split()[1]) <= stopped < 40
    assert (tmp_path / "run" / f"step_{stopped:08d}" / "plait_checkpoint.json").is_file()

    resumed = _run(tmp_path / "run", 40, "thread", "--resume")
    out, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, err
    assert [ln for ln in out.splitlines() if ln.startswith("step")] == reference[stopped:]


def test_export_checkpoint_to_safetensors(tmp_path):
    from plait.loop.checkpoint import export_checkpoint
    from plait.model_state import Rename
    from safetensors.torch import load_file

    model, opt = _setup()
    _train(model, opt, 2)
    ck = Checkpointer(tmp_path / "ckpt", async_mode="off")
    ck.save(2, _state(model, opt, 2))
    fresh, _ = _setup(seed=5)
    out = export_checkpoint(ck.latest(), fresh, tmp_path / "hf", Rename({"{i}.{p}": "net.{i}.{p}"}))
    exported = load_file(out / "model.safetensors")
    assert sorted(exported) == ["net.0.bias", "net.0.weight", "net.2.bias", "net.2.weight"]
    for key, value in model.state_dict().items():
        assert torch.equal(exported[f"net.{key}"], value)


class _Counting(ValueState):
    calls = 0

    def state_dict(self):  # type: ignore[no-untyped-def]
        type(self).calls += 1
        return super().state_dict()


def test_load_builds_each_state_dict_once(tmp_path):
    """load() checks and restores through one state_dict() per Stateful (optimizer state dicts of sharded
    models are expensive to build)."""
    ck = Checkpointer(tmp_path, async_mode="off")
    ck.save(1, {"v": ValueState(7)})
    target = _Counting(0)
    ck.load(ck.latest(), {"v": target})
    assert target.value == 7 and _Counting.calls == 1
