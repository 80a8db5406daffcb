"""The main job rerun on a finished run leaves it as it was; a dataset smaller than one global batch is a
one-line error in records and tokens, exit 2."""

from __future__ import annotations

import json

import pytest
from plait.loop import EventBus, TrainingEnd, TrainingStart
from plait.loop.tracking import RunSummaryCollector, RunTotals
from plait.train.train import main

from tests.e2e.test_pretrain_cli import TINY, _fails, pretrain  # noqa: F401  (the fixture)


def test_a_rerun_of_a_finished_run_changes_nothing(tmp_path, capsys):
    run_dir = tmp_path / "run"
    argv = [a for a in TINY if a != "--checkpoint.enabled=false"]
    argv += ["--steps", "2", "--run-dir", str(run_dir), "--no-export", "--evaluation.enabled=false"]
    main(argv)
    summary, metrics = (run_dir / "summary.json").read_text(), (run_dir / "metrics.jsonl").read_text()
    assert json.loads(summary)["final_loss"] is not None
    capsys.readouterr()
    assert main(argv) == {}
    assert f"{run_dir}: already finished at step 2; nothing to do" in capsys.readouterr().out
    assert (run_dir / "summary.json").read_text() == summary
    assert (run_dir / "metrics.jsonl").read_text() == metrics


def test_a_session_without_steps_keeps_the_runs_summary(tmp_path):
    """The Trainer alone (fit() on a finished run, then close()) leaves ``summary.json`` as it was."""
    (tmp_path / "summary.json").write_text('{"final_loss": 1.5}')
    events = EventBus()
    collector = RunSummaryCollector(events, mfu=lambda tps: None, is_main=True)
    events.publish(TrainingStart(4, 4, 100))
    events.publish(TrainingEnd(4, stopped_early=False))
    assert (
        collector.write(tmp_path, RunTotals(step=4, total_steps=4, skipped_steps=0, tokens_seen=100)) is None
    )
    assert (tmp_path / "summary.json").read_text() == '{"final_loss": 1.5}'


@pytest.mark.parametrize("split", ["training", "validation"])
def test_data_smaller_than_one_global_batch_is_one_line_and_exit_2(pretrain, capsys, tmp_path, split):  # noqa: F811
    """Today: a 20-line traceback ending in ``the dataset has 4 samples, fewer than one global batch (16)``."""
    source = tmp_path / "small.jsonl"
    source.write_text("".join(json.dumps({"text": f"record {i} " + "x" * 50}) + "\n" for i in range(10)))
    common = ["--run-dir", str(tmp_path / "r"), f"--data.source={source}", "--batching.seq_len=64",
              "--data.validation_split=documents"]  # fmt: skip
    if split == "training":
        argv = [*common, "--evaluation.enabled=false", "--batching.global_batch_size=16",
                "--batching.microbatch_size=8", "--data.validation_documents=1"]  # fmt: skip
        expected = (
            "data.source (training): 9 record(s) (540 tokens) pack into 8 row(s) of batching.seq_len=64, "
            "fewer than one global batch of batching.global_batch_size=16 rows (1,025 tokens)"
        )
    else:
        argv = [*common, "--evaluation.enabled=true", "--batching.global_batch_size=4",
                "--batching.microbatch_size=4", "--data.validation_documents=3"]  # fmt: skip
        expected = (
            "data.source (held out for validation): 3 record(s) (180 tokens) pack into 2 row(s) of "
            "batching.seq_len=64, fewer than one global batch of batching.global_batch_size=4 rows"
        )
    err = _fails(pretrain, capsys, argv)
    assert expected in err and err.count("\n") == 1, err
