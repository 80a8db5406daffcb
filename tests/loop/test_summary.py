"""The run summary's steady-state figures and validation losses, compile detection in the throughput
meter, and the loss curve's val_loss line."""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path

import pytest
import torch
from plait.loop.events import EventBus, MetricsLogged, TrainingEnd, TrainingStart
from plait.loop.tracking import (
    Interval,
    RunSummaryCollector,
    RunTotals,
    ThroughputMeter,
    compiled_graphs,
    plots,
)


@pytest.mark.slow  # the first torch.compile imports dynamo (seconds)
def test_compiled_graphs_counts_dynamo_compilations_and_marks_the_interval() -> None:
    meter = ThroughputMeter(None, None, world_size=1)
    before = compiled_graphs()
    fn = torch.compile(lambda x: x * 2 + 1, backend="eager")
    fn(torch.ones(3))
    assert compiled_graphs() == before + 1
    meter.add(10)
    meter.measure()
    assert (
        meter.last_interval is not None and meter.last_interval.compiled and meter.last_interval.tokens == 10
    )
    fn(torch.ones(3))  # cached: nothing compiled
    meter.measure()
    assert not meter.last_interval.compiled
    torch.compile(lambda x: x - 1, backend="eager")(torch.ones(2))  # e.g. the evaluation compiling ...
    meter.exclude(0.0)  # ... inside time left out of the interval
    meter.measure()
    assert not meter.last_interval.compiled


def _collector(flops: float | None, peak: float | None) -> tuple[EventBus, RunSummaryCollector]:
    events, meter = EventBus(), ThroughputMeter(flops, peak, world_size=2)
    return events, RunSummaryCollector(events, mfu=meter.mfu, is_main=True)


def test_steady_state_leaves_out_the_first_interval_and_compiling_ones() -> None:
    events, collector = _collector(flops=6e6, peak=1e12)
    events.publish(TrainingStart(0, total_steps=40, tokens_seen=0))
    # (step, interval tokens, seconds, compiled, val_loss): intervals of 10 steps
    rows = [(10, 1000, 10.0, True, None), (20, 1000, 1.0, False, 3.0), (30, 1000, 5.0, True, None),
            (40, 1000, 2.0, False, 3.5)]  # fmt: skip
    for step, tokens, seconds, compiled, val in rows:
        metrics = {"loss": 2.0, "tokens_per_s": tokens / seconds}
        if val is not None:
            metrics["val_loss"] = val
        events.publish(MetricsLogged(step, metrics, Interval(tokens, seconds, compiled)))
    events.publish(TrainingEnd(40, stopped_early=False))
    s = collector.summary(RunTotals(step=40, total_steps=40, skipped_steps=0, tokens_seen=4000))
    # intervals 2 and 4 only: 2000 tokens over 3 s
    assert s.steady_tokens_per_s == pytest.approx(2000 / 3.0)
    assert s.steady_steps == 20
    assert s.steady_mfu == pytest.approx(6e6 * (2000 / 3.0) / (1e12 * 2))
    assert (s.last_val_loss, s.best_val_loss, s.best_val_step) == (3.5, 3.0, 20)
    assert (s.steps, s.steps_this_session, s.tokens, s.stopped_early) == (40, 40, 4000, False)
    text = s.format()
    assert "steady state 667 tok/s, MFU 0.20% (20 steps)" in text and "whole run" in text
    assert "val_loss 3.5000 (best 3.0000 at step 20)" in text and "n/a" not in text


def test_summary_without_peak_or_steady_intervals_leaves_them_out() -> None:
    events, collector = _collector(flops=None, peak=None)
    events.publish(TrainingStart(0, total_steps=40, tokens_seen=0))
    events.publish(MetricsLogged(5, {"loss": 1.0, "tokens_per_s": 100.0}, Interval(100, 1.0, False)))
    s = collector.summary(RunTotals(step=5, total_steps=40, skipped_steps=0, tokens_seen=100))
    assert s.steady_tokens_per_s is None and s.steady_steps == 0 and s.mean_mfu is None
    assert s.stopped_early  # no TrainingEnd
    text = s.format()
    assert "MFU" not in text and "steady" not in text and "n/a" not in text and "val_loss" not in text


def test_a_resumed_session_counts_its_own_steps_and_tokens() -> None:
    events, collector = _collector(flops=None, peak=None)
    events.publish(TrainingStart(30, total_steps=40, tokens_seen=3000))  # resumed at step 30
    events.publish(MetricsLogged(40, {"loss": 1.0, "tokens_per_s": 100.0}, Interval(1000, 10.0, False)))
    events.publish(TrainingEnd(40, stopped_early=False))
    ckpt = Path("checkpoints/step_00000040")
    s = collector.summary(RunTotals(40, 40, skipped_steps=2, tokens_seen=4000, checkpoint=ckpt))
    assert (s.steps, s.steps_this_session, s.skipped_steps, s.tokens) == (40, 10, 2, 4000)
    assert s.checkpoint == str(ckpt) and s.mean_tokens_per_s == pytest.approx(1000 / s.wall_time_s)
    assert "step 40/40 (10 this session, 2 skipped), 4,000 tokens" in s.format()


def test_loss_curve_draws_val_loss_beside_the_training_loss(tmp_path, monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(plots, "plot_series", lambda *a, **k: calls.append((a, k)))
    records = [{"step": 1, "loss": 4.0}, {"step": 2, "loss": 3.0, "val_loss": 3.5},
               {"step": 3, "loss": float("nan")}, {"step": 4, "loss": 2.5, "val_loss": 3.25}]  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\nnot json\n")
    assert plots.plot_loss_curve(tmp_path / "metrics.jsonl", tmp_path / "c.png") == 3
    ((args, kwargs),) = calls
    assert list(args[0]) == [1, 2, 4] and list(args[1]) == [4.0, 3.0, 2.5]
    assert [(list(x), list(y), label) for x, y, label in kwargs["extra"]] == [
        ([2, 4], [3.5, 3.25], "val_loss")
    ]


def test_loss_curve_png_with_val_loss(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    records = [
        {"step": s, "loss": 4.0 / s} | ({"val_loss": 4.5 / s} if s % 2 == 0 else {}) for s in range(1, 7)
    ]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    assert plots.plot_loss_curve(tmp_path / "metrics.jsonl", tmp_path / "c.png") == 6
    assert (tmp_path / "c.png").read_bytes().startswith(b"\x89PNG")


def test_measured_cpu_matmul_rate_is_a_plausible_peak() -> None:
    from plait.loop.tracking import measure_matmul_flops

    rate = measure_matmul_flops(torch.device("cpu"), size=256, trials=2)
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    t0 = time.perf_counter()
    for _ in range(4):
        torch.mm(a, b)
    mean_rate = 4 * 2 * 256**3 / (time.perf_counter() - t0)
    assert 1e8 < rate < 1e14  # between a very slow core and far beyond any CPU
    assert rate > 0.2 * mean_rate  # a best-of measurement is not far below a plain timing


def test_a_runs_steady_state_figures_agree_with_its_interval_rows(tmp_path) -> None:
    from plait.loop import CausalLMTask, DatasetProvider, ModuleProvider, Trainer, load_config, pack_documents

    from tests.loop._lm import VOCAB, TinyLM, pattern_tokens

    cfg = load_config(
        overrides=[f"--run.run_dir={tmp_path}", "--run.steps=8", "--logging.interval=2", "--logging.progress_bar=false",
                   "--batching.global_batch_size=8", "--batching.microbatch_size=4", "--batching.seq_len=16",
                   "--logging.peak_flops=1e11"]
    )  # fmt: skip
    data = DatasetProvider(pack_documents(pattern_tokens(), 16, eos_id=VOCAB - 1))
    tr = Trainer(cfg, ModuleProvider(TinyLM, flops_per_token=1e4), data, CausalLMTask())
    tr.fit()
    tr.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 4, 6, 8]
    # every interval after the first (nothing compiles here): its tokens, and seconds = tokens / its rate
    tokens = [b["tokens_seen"] - a["tokens_seen"] for a, b in itertools.pairwise(rows)]
    seconds = [t / r["tokens_per_s"] for t, r in zip(tokens, rows[1:])]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steady_steps"] == 6 and summary["tokens"] == 8 * 8 * 16 == rows[-1]["tokens_seen"]
    assert summary["steady_tokens_per_s"] == pytest.approx(sum(tokens) / sum(seconds), rel=1e-9)
    mfu_per_token = rows[-1]["mfu"] / rows[-1]["tokens_per_s"]  # the peak set, one device
    assert mfu_per_token == pytest.approx(1e4 / 1e11, rel=1e-9)  # FLOPs per token over the peak
    assert summary["steady_mfu"] == pytest.approx(summary["steady_tokens_per_s"] * mfu_per_token, rel=1e-9)
    assert (summary["steps"], summary["total_steps"], summary["stopped_early"]) == (8, 8, False)
