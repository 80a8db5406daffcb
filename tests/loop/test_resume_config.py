"""When a resume happens (not at construction: in resume(), which fit() calls) and what it may change:
allowed settings are applied (not the optimizer's saved ones) and logged; shapes, global batch,
sequence length and seed are refused naming field and values; a checkpoint past run.steps is refused
naming both steps."""

from __future__ import annotations

import json
import logging
import re

import pytest
import torch
from plait.loop import (
    CausalLMTask,
    DatasetProvider,
    ModuleProvider,
    Trainer,
    TrainingStart,
    load_config,
    pack_documents,
)
from plait.loop.checkpoint.resume_policy import ResumeConfigError

from tests.loop._lm import VOCAB, TinyLM, pattern_tokens


def _trainer(run_dir, steps: int, *extra: str) -> Trainer:
    cfg = load_config(
        overrides=[
            f"--run.run_dir={run_dir}",
            f"--run.steps={steps}",
            "--batching.global_batch_size=8",
            "--batching.microbatch_size=4",
            "--batching.seq_len=16",
            "--logging.progress_bar=false",
            "--checkpoint.enabled=true",
            "--checkpoint.async_mode=off",
            '--lr_schedule.segments=[{"kind": "constant"}]',
            *extra,
        ]
    )
    data = DatasetProvider(pack_documents(pattern_tokens(), cfg.batching.seq_len, eos_id=VOCAB - 1))
    return Trainer(cfg, ModuleProvider(TinyLM), data, CausalLMTask())


def _train(run_dir, steps: int, *extra: str) -> Trainer:
    tr = _trainer(run_dir, steps, *extra)
    tr.fit()
    tr.close()
    return tr


def test_changed_hyper_parameters_are_applied_and_logged(tmp_path, caplog):
    _train(tmp_path, 3, "--optimizer.lr=3e-3", "--optimizer.weight_decay=0.1")
    plait_log = logging.getLogger("plait")  # the trainer's logger does not propagate: listen on it
    plait_log.addHandler(caplog.handler)
    try:
        tr = _trainer(
            tmp_path,
            5,
            "--optimizer.lr=1e-4",
            "--optimizer.weight_decay=0.01",
            "--optimizer.betas=[0.8, 0.9]",
        )
        tr.resume()
    finally:
        plait_log.removeHandler(caplog.handler)
    assert tr.step == 3
    decay, no_decay = tr.optimizers[0].param_groups
    assert decay["lr"] == no_decay["lr"] == pytest.approx(1e-4)  # not the checkpoint's 3e-3
    assert decay["weight_decay"] == pytest.approx(0.01) and no_decay["weight_decay"] == 0.0
    assert decay["betas"] == (0.8, 0.9)
    logged = caplog.text
    for line in ("changes optimizer.lr: 0.003 -> 0.0001", "changes optimizer.weight_decay: 0.1 -> 0.01",
                 "changes run.steps: 3 -> 5"):  # fmt: skip
        assert line in logged
    tr.fit()
    tr.close()
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    lrs = {r["step"]: r["lr"] for r in records if "lr" in r}
    assert lrs[3] == pytest.approx(3e-3) and lrs[4] == lrs[5] == pytest.approx(1e-4)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("--batching.global_batch_size=16", "batching.global_batch_size: 8 in the checkpoint, 16 now"),
        ("--batching.seq_len=8", "batching.seq_len: 16 in the checkpoint, 8 now"),
        ("--run.seed=7", "run.seed: 0 in the checkpoint, 7 now"),
    ],
)
def test_fixed_fields_are_refused_naming_both_values(tmp_path, override, message):
    _train(tmp_path, 2)
    tr = _trainer(tmp_path, 4, override)  # builds: the checkpoint is not read yet
    with pytest.raises(ResumeConfigError, match="a resume may not change") as e:
        tr.fit()
    tr.close()
    assert message in str(e.value)


def test_a_checkpoint_past_the_requested_steps_is_refused(tmp_path):
    _train(tmp_path, 4)
    refused = _trainer(tmp_path, 2)
    with pytest.raises(ResumeConfigError, match=r"is at step 4, past run\.steps=2"):
        refused.resume()
    refused.close()
    tr = _trainer(tmp_path, 4)  # the same length: nothing left to train, nothing refused
    assert tr.resume() == tmp_path / "checkpoints" / "step_00000004" and tr.step == 4
    tr.close()


def _weights(tr: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in tr.model_parts[0].named_parameters()}


def test_construction_loads_no_checkpoint_until_resume(tmp_path):
    saved = _weights(_train(tmp_path / "run", 3))  # the final weights are checkpoint step 3's
    init = _weights(_trainer(tmp_path / "fresh", 5))  # the same seed, no checkpoint: initial weights
    assert any(not torch.equal(init[n], saved[n]) for n in init)

    tr = _trainer(tmp_path / "run", 5)
    assert tr.step == 0 and tr.data_loader.state_dict()["batches_consumed"] == 0
    assert all(torch.equal(w, init[n]) for n, w in _weights(tr).items())  # built, nothing loaded
    schedule_before = tr.lr_scheduler.state_dict()

    assert tr.resume() == tmp_path / "run" / "checkpoints" / "step_00000003"
    assert tr.step == 3 and tr.data_loader.state_dict()["batches_consumed"] == 3
    assert all(torch.equal(w, saved[n]) for n, w in _weights(tr).items())
    assert tr.lr_scheduler.state_dict() != schedule_before  # the schedule's position came back too

    with torch.no_grad():
        tr.model_parts[0].head.weight.zero_()
    assert tr.resume() == tmp_path / "run" / "checkpoints" / "step_00000003"  # once: nothing reloaded
    assert not tr.model_parts[0].head.weight.any()
    tr.close()


def test_fit_resumes_before_its_first_step(tmp_path):
    _train(tmp_path, 3)
    tr = _trainer(tmp_path, 5)
    starts: list[TrainingStart] = []
    tr.subscribe(TrainingStart, starts.append)
    tr.fit()
    tr.close()
    assert [(e.step, e.total_steps) for e in starts] == [(3, 5)]
    assert starts[0].tokens_seen == 3 * 8 * 16  # three global batches of 8 x 16 positions
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4, 5]  # the second run logged 4 and 5
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (summary["steps"], summary["steps_this_session"]) == (5, 2)


def test_a_field_newer_than_the_checkpoint_is_not_a_change(tmp_path, caplog):
    """A checkpoint written before a config field existed resumes (the field logged); a field it has and
    that changed is still refused."""
    from plait.loop.checkpoint.resume_policy import check_resume_config

    saved = {"data": {"source": "a.jsonl", "seq_len": 8}}
    now = {"data": {"source": "a.jsonl", "seq_len": 8, "validation_split": "auto"}}
    with caplog.at_level(logging.WARNING):
        assert check_resume_config(tmp_path, {"step": 1, "config": saved}, now, ["data"], 10) == {
            "data.validation_split": (None, "auto")
        }
    assert "predates the field data.validation_split" in caplog.text
    changed = {"data": {"source": "b.jsonl", "seq_len": 8, "validation_split": "auto"}}
    with pytest.raises(
        ResumeConfigError, match=re.escape("data.source: 'a.jsonl' in the checkpoint, 'b.jsonl' now")
    ):
        check_resume_config(tmp_path, {"step": 1, "config": saved}, changed, ["data"], 10)
