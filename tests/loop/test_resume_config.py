"""What a resume may change: allowed settings are applied (not the optimizer's saved ones) and
logged; shapes, global batch, sequence length and seed are refused naming field and values; a
checkpoint past run.steps is refused naming both steps."""

from __future__ import annotations

import json
import logging

import pytest
from plait.loop import CausalLMTask, DatasetProvider, ModuleProvider, Trainer, load_config, pack_documents
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
    with pytest.raises(ResumeConfigError, match="a resume may not change") as e:
        _trainer(tmp_path, 4, override)
    assert message in str(e.value)


def test_a_checkpoint_past_the_requested_steps_is_refused(tmp_path):
    _train(tmp_path, 4)
    with pytest.raises(ResumeConfigError, match=r"is at step 4, past run\.steps=2"):
        _trainer(tmp_path, 2)
    tr = _trainer(tmp_path, 4)  # the same length: nothing left to train, nothing refused
    assert tr.step == 4
    tr.close()
