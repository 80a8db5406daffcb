"""The run summary's steady-state figures and validation losses, compile detection in the throughput
meter, and the loss curve's val_loss line."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest
import torch
from plait.loop.events import EventBus, MetricsLogged, TrainingEnd, TrainingStart
from plait.loop.tracking import Interval, RunSummaryCollector, ThroughputMeter, compiled_graphs, plots


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


def _trainer(flops: float | None, peak: float | None) -> SimpleNamespace:
    return SimpleNamespace(
        events=EventBus(),
        state=SimpleNamespace(tokens_seen=0, skipped_steps=0),
        throughput=ThroughputMeter(flops, peak, world_size=2),
        step=0,
        config=SimpleNamespace(run=SimpleNamespace(steps=40)),
        checkpointer=None,
        topology=SimpleNamespace(is_main=True),
    )


def test_steady_state_leaves_out_the_first_interval_and_compiling_ones() -> None:
    tr = _trainer(flops=6e6, peak=1e12)
    collector = RunSummaryCollector(tr)
    tr.events.publish(TrainingStart(tr, 0))
    # (step, interval tokens, seconds, compiled, val_loss): intervals of 10 steps
    rows = [(10, 1000, 10.0, True, None), (20, 1000, 1.0, False, 3.0), (30, 1000, 5.0, True, None),
            (40, 1000, 2.0, False, 3.5)]  # fmt: skip
    for step, tokens, seconds, compiled, val in rows:
        tr.throughput.last_interval = Interval(tokens, seconds, compiled)
        metrics = {"loss": 2.0, "tokens_per_s": tokens / seconds}
        if val is not None:
            metrics["val_loss"] = val
        tr.step, tr.state.tokens_seen = step, tr.state.tokens_seen + tokens
        tr.events.publish(MetricsLogged(tr, step, metrics))
    tr.events.publish(TrainingEnd(tr, 40, stopped_early=False))
    s = collector.summary()
    # intervals 2 and 4 only: 2000 tokens over 3 s
    assert s.steady_tokens_per_s == pytest.approx(2000 / 3.0)
    assert s.steady_steps == 20
    assert s.steady_mfu == pytest.approx(6e6 * (2000 / 3.0) / (1e12 * 2))
    assert (s.last_val_loss, s.best_val_loss, s.best_val_step) == (3.5, 3.0, 20)
    text = s.format()
    assert "steady state 667 tok/s, MFU 0.20% (20 steps)" in text and "whole run" in text
    assert "val_loss 3.5000 (best 3.0000 at step 20)" in text and "n/a" not in text


def test_summary_without_peak_or_steady_intervals_leaves_them_out() -> None:
    tr = _trainer(flops=None, peak=None)
    collector = RunSummaryCollector(tr)
    tr.events.publish(TrainingStart(tr, 0))
    tr.throughput.last_interval = Interval(100, 1.0, False)
    tr.step, tr.state.tokens_seen = 5, 100
    tr.events.publish(MetricsLogged(tr, 5, {"loss": 1.0, "tokens_per_s": 100.0}))
    s = collector.summary()
    assert s.steady_tokens_per_s is None and s.steady_steps == 0 and s.mean_mfu is None
    text = s.format()
    assert "MFU" not in text and "steady" not in text and "n/a" not in text and "val_loss" not in text


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
