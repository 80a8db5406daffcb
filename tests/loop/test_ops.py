"""Trackers, throughput/MFU, GC control and log prefixes."""

from __future__ import annotations

import gc
import json
import logging
import sys
import time

import pytest
from plait.loop import ConsoleTracker, JSONLTracker, build_tracker
from plait.loop.config import GCConfig
from plait.loop.ops import GCController, mesh_prefix, setup_logging
from plait.loop.tracking import ThroughputMeter


def test_jsonl_tracker_appends_records(tmp_path):
    t = JSONLTracker(tmp_path)
    t.log_config({"run": {"steps": 3}})
    t.log({"loss": 1.5, "lr": 0.1, "grad_norm": float("nan")}, step=1)
    t.close()
    t = JSONLTracker(tmp_path)  # a resumed run appends
    t.log({"loss": 1.0}, step=2)
    t.close()
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2]
    assert lines[0]["loss"] == 1.5 and lines[0]["grad_norm"] is None
    assert json.loads((tmp_path / "config.json").read_text()) == {"run": {"steps": 3}}


def test_console_tracker_line():
    lines: list[str] = []
    ConsoleTracker(lines.append, total_steps=10).log({"zeta": 2.0, "lr": 3e-4, "loss": 2.25}, step=4)
    assert lines == ["step 4/10 | loss 2.25 | lr 3.000e-04 | zeta 2"]


@pytest.mark.parametrize("kind,extra", [("tensorboard", "tensorboard"), ("aim", "aim"), ("wandb", "wandb")])
def test_optional_trackers_name_their_extra(tmp_path, kind, extra):
    import importlib.util

    if importlib.util.find_spec(kind) is not None:
        pytest.skip(f"{kind} is installed")
    with pytest.raises(ImportError, match=rf"plait-loop\[{extra}\]"):
        build_tracker(kind, tmp_path)
    with pytest.raises(ValueError, match="unknown tracker kind 'nope'"):
        build_tracker("nope", tmp_path)


def test_throughput_and_mfu():
    meter = ThroughputMeter(flops_per_token=6e6, peak_flops=1e12, world_size=2)
    meter.add(1000)
    out = meter.measure()
    assert out["tokens_per_s_per_device"] == pytest.approx(out["tokens_per_s"] / 2)
    assert out["mfu"] == pytest.approx(6e6 * out["tokens_per_s"] / 2e12)


def test_gc_controller():
    was = gc.isenabled()
    gcc = GCController(GCConfig(disable_automatic=True, interval=2))
    gcc.start()
    assert not gc.isenabled()
    for step in range(1, 6):
        gcc.step(step)
    assert gcc.collections == 2
    gcc.stop()
    assert gc.isenabled() == was


def test_mesh_prefixed_logs(capsys):
    prefix = mesh_prefix(3, {"pp": 1, "dp": 1, "tp": 0}, {"pp": 2, "dp": 2, "tp": 1})
    assert prefix == "[rank 3 pp1 dp1]"
    log = setup_logging(prefix, "INFO", logger_name="plait.test_ops")
    log.info("hello")
    assert "[rank 3 pp1 dp1] INFO hello" in capsys.readouterr().err
    logging.getLogger("plait.test_ops").handlers.clear()


def test_a_log_line_under_an_open_progress_bar_gets_a_line_of_its_own(capsys):
    from tqdm import tqdm

    log = setup_logging("[rank 0]", "INFO", logger_name="plait.test_bar")
    bar = tqdm(total=10, desc="run", file=sys.stderr)
    bar.update(3)
    log.info("a log line")
    bar.close()
    err = capsys.readouterr().err
    lines = [line.split("\r")[-1] for line in err.split("\n")]  # what each terminal line ends up showing
    assert any(line.endswith("[rank 0] INFO a log line") and "run:" not in line for line in lines), err
    logging.getLogger("plait.test_bar").handlers.clear()


def test_throughput_reports_the_data_wait_fraction():
    meter = ThroughputMeter(flops_per_token=None, peak_flops=None, world_size=1)
    time.sleep(0.1)
    meter.add_data_wait(0.05)
    assert 0.2 < meter.measure()["data_wait_frac"] <= 0.5
    assert meter.measure()["data_wait_frac"] == 0.0  # reset with the interval
