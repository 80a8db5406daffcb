"""A diverged run never becomes a checkpoint or a normal return: non-finite parameters stop the save
and the end of fit(); the skip policy stops after a run of skipped steps; the summary counts them."""

from __future__ import annotations

import json

import pytest
import torch
from plait.loop import CausalLMTask, DatasetProvider, ModuleProvider, Trainer, load_config, pack_documents

from tests.loop._lm import VOCAB, TinyLM, pattern_tokens

HUGE_LR = "--optimizer.lr=1e30"  # step 1 takes the parameters to ~1e30: every later loss overflows


def _trainer(run_dir, steps: int, *extra: str, task=None) -> Trainer:
    cfg = load_config(
        overrides=[
            f"--run.run_dir={run_dir}",
            f"--run.steps={steps}",
            "--batching.global_batch_size=4",
            "--batching.microbatch_size=4",
            "--batching.seq_len=16",
            "--logging.progress_bar=false",
            '--lr_schedule.segments=[{"kind": "constant"}]',
            *extra,
        ]
    )
    data = DatasetProvider(pack_documents(pattern_tokens(), 16, eos_id=VOCAB - 1))
    return Trainer(cfg, ModuleProvider(TinyLM), data, task or CausalLMTask())


class _HugeGradients:
    """The causal-LM task with its objective (not its reported loss) scaled by 1e15: finite loss and
    gradient norm, but an SGD step of lr 1e30 takes the parameters to inf."""

    def __init__(self) -> None:
        self.inner = CausalLMTask()

    def stage_inputs(self, batch, stage_index, num_stages):
        return self.inner.stage_inputs(batch, stage_index, num_stages)

    def num_loss_tokens(self, batch):
        return self.inner.num_loss_tokens(batch)

    def loss(self, outputs, batch):
        lo = self.inner.loss(outputs, batch)
        return type(lo)(lo.objective * 1e15, lo.loss_sum, lo.num_tokens)


def test_nonfinite_parameters_never_become_a_checkpoint(tmp_path):
    tr = _trainer(
        tmp_path, 2, "--optimizer.name=sgd", "--optimizer.lr=1e30", "--grad_clip.max_norm=null",
        "--checkpoint.enabled=true", "--checkpoint.interval=1", "--checkpoint.async_mode=off",
        task=_HugeGradients(),
    )  # fmt: skip
    with pytest.raises(
        FloatingPointError,
        match=r"non-finite parameters after step 1 \(here: .*checkpoint step 1 not written",
    ):
        tr.fit()
    tr.close()
    assert not list((tmp_path / "checkpoints").glob("step_*"))
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["error"].startswith("FloatingPointError: non-finite parameters after step 1")


def test_fit_does_not_end_normally_on_skipped_steps(tmp_path, capsys):
    # skip policy, fewer steps than the consecutive-skip limit: step 1 trains to parameters ~1e30,
    # every later loss is inf/NaN and skipped; the run must not end as if it had trained
    tr = _trainer(tmp_path, 4, HUGE_LR, "--determinism.nonfinite_loss=skip", "--checkpoint.enabled=true")
    with pytest.raises(FloatingPointError, match=r"the run ended on 3 skipped step\(s\) in a row"):
        tr.fit()
    tr.close()
    assert tr.state.skipped_steps == 3 and not list((tmp_path / "checkpoints").glob("step_*"))
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["skipped_steps"] == 3 and summary["final_loss"] is None
    assert "run FAILED: step 4/4 (4 this session, 3 skipped)" in capsys.readouterr().out


def test_skip_policy_stops_after_consecutive_skips(tmp_path):
    tr = _trainer(
        tmp_path,
        50,
        HUGE_LR,
        "--determinism.nonfinite_loss=skip",
        "--determinism.max_consecutive_skipped_steps=5",
    )
    with pytest.raises(
        FloatingPointError, match=r"5 steps in a row skipped .* at step 5 on rank 0\): the run has diverged"
    ):
        tr.fit()
    tr.close()
    assert tr.step == 5 and tr.state.skipped_steps == 5
    assert load_config().determinism.max_consecutive_skipped_steps == 10  # on by default


def test_check_finite_names_each_nonfinite_parameter(tmp_path):
    tr = _trainer(tmp_path, 1)
    tr.check_finite("nothing")  # a fresh model is finite
    for value in (float("inf"), float("-inf"), float("nan")):
        with torch.no_grad():
            tr.model_parts[0].up.weight[3, 5] = value
            tr.model_parts[0].head.weight[0, 0] = value
        with pytest.raises(
            FloatingPointError, match=r"\(here: up\.weight, head\.weight; rank 0\).*; the test not written"
        ):
            tr.check_finite("the test")
        with torch.no_grad():
            tr.model_parts[0].up.weight[3, 5] = 0.0
            tr.model_parts[0].head.weight[0, 0] = 0.0
    tr.check_finite("nothing")
    tr.close()
