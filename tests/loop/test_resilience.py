"""Runs that heal themselves: the heartbeat file, stragglers named over gloo, and the step watchdog
(limits on a fake clock; a hung step in a subprocess exits with status 75 naming its phase; a rank that
waits for a stuck one names it and the collective it waits in)."""

from __future__ import annotations

import json
import os
import re
import sys
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from plait.dist_core.testing import run_distributed
from plait.loop import (
    BeforeOptimizerStep,
    CausalLMTask,
    DatasetProvider,
    EventBus,
    MetricsLogged,
    ModuleProvider,
    StepEnd,
    Trainer,
    load_config,
    pack_documents,
)
from plait.loop.config import ConfigError
from plait.loop.config.sections import TimeoutConfig, WatchdogConfig
from plait.loop.resilience import (
    HEARTBEAT_FILE,
    RANK_DELAY_ENV,
    WATCHDOG_EXIT_CODE,
    Heartbeat,
    StepWatchdog,
    dump_nccl_flight_recorder,
    find_straggler,
    rank_delay_from_env,
    watchdog_enabled,
)
from plait.loop.resilience.diagnosis import (
    Beacon,
    CollectiveWait,
    collective_wait,
    find_collective,
    name_stuck_ranks,
)
from plait.loop.resilience.flight_recorder import default_store, nccl_trace_dumper

from tests.loop._lm import VOCAB, TinyLM, pattern_tokens


def _config(run_dir: str, *extra: str, steps: int = 3, dp: int = 1):
    return load_config(
        overrides=[
            f"--run.run_dir={run_dir}",
            f"--run.steps={steps}",
            f"--mesh.data_shard={dp}",
            "--batching.global_batch_size=8",
            "--batching.microbatch_size=4",
            "--batching.seq_len=16",
            "--logging.progress_bar=false",
            "--logging.trackers=[]",
            "--logging.peak_flops=1e12",  # no FLOP/s measurement at start-up
            *extra,
        ]
    )


def _trainer(cfg) -> Trainer:
    data = DatasetProvider(pack_documents(pattern_tokens(), 16, eos_id=VOCAB - 1))
    return Trainer(cfg, ModuleProvider(TinyLM), data, CausalLMTask())


# ---------------------------------------------------------------------------------------- heartbeat
def test_a_run_leaves_a_heartbeat_with_its_last_step(tmp_path):
    torch.set_num_threads(1)
    tr = _trainer(_config(str(tmp_path), "--logging.heartbeat_interval_s=1000"))
    seen: list[dict] = []
    tr.subscribe(StepEnd, lambda e: seen.append(json.loads((tmp_path / HEARTBEAT_FILE).read_text())))
    tr.fit()
    tr.close()
    # throttled: after the steps the file still holds the start's beat; the end is always written
    assert [(s["step"], s["phase"]) for s in seen] == [(0, "starting")] * 3
    beat = json.loads((tmp_path / HEARTBEAT_FILE).read_text())
    assert beat["step"] == 3 and beat["total_steps"] == 3 and beat["phase"] == "finished"
    assert beat["tokens_seen"] == 3 * 8 * 16 and beat["pid"] == os.getpid()
    assert abs(beat["time"] - time.time()) < 60
    assert not list(tmp_path.glob(f".{HEARTBEAT_FILE}*"))  # no temporary file left


def test_heartbeat_throttles_marks_phases_and_can_be_off(tmp_path):
    now = [100.0]
    hb = Heartbeat(tmp_path / HEARTBEAT_FILE, 10.0, clock=lambda: now[0])

    def read() -> tuple[int, str, float]:
        b = json.loads((tmp_path / HEARTBEAT_FILE).read_text())
        return b["step"], b["phase"], b["time"]

    assert hb.beat(1, "training") and read() == (1, "training", 100.0)
    now[0] = 105.0
    assert not hb.beat(2, "training") and read()[0] == 1  # younger than 10 s
    with hb.phase("checkpoint", 2):
        assert read() == (2, "checkpoint", 105.0)  # phases are always written
    assert read()[1] == "training"
    now[0] = 116.0
    assert hb.beat(3, "training") and read() == (3, "training", 116.0)
    assert Heartbeat.for_run(tmp_path / "x", None, EventBus(), is_main=True).path is None
    assert Heartbeat.for_run(tmp_path / "x", 5.0, EventBus(), is_main=False).path is None
    assert not Heartbeat(None).beat(1, "training", force=True)


# ---------------------------------------------------------------------------------------- stragglers
def test_find_straggler_against_the_lower_median():
    r = find_straggler([0.10, 0.30], [0.0, 0.25], threshold=0.2)
    assert (
        (r.rank, r.flagged) == (1, True)
        and r.lag_s == pytest.approx(0.2)
        and r.lag_frac == pytest.approx(2.0)
    )
    assert r.data_wait_s == 0.25 and "rank 1" in r.describe()
    quiet = find_straggler([1.0, 1.05, 0.98, 1.1], [0.0] * 4, threshold=0.2)
    assert quiet.rank == 3 and not quiet.flagged and quiet.lag_s == pytest.approx(0.1)
    assert set(quiet.metrics()) == {
        "straggler_rank",
        "straggler_lag_s",
        "straggler_lag_frac",
        "straggler_flagged",
    }


def test_rank_delay_env_is_parsed_and_errors_name_it():
    assert rank_delay_from_env(1, {RANK_DELAY_ENV: "0:0.5, 1:0.25"}) == 0.25
    assert rank_delay_from_env(2, {RANK_DELAY_ENV: "1:0.25"}) == 0.0
    assert rank_delay_from_env(0, {}) == 0.0
    for bad in ("1", "a:0.1", "1:-2"):
        with pytest.raises(ValueError, match=RANK_DELAY_ENV):
            rank_delay_from_env(1, {RANK_DELAY_ENV: bad})


def _straggler_run(run_dir: str) -> tuple[list[dict[str, float]], dict]:
    os.environ[RANK_DELAY_ENV] = "1:0.2"  # the harness restores the environment afterwards
    torch.set_num_threads(1)
    tr = _trainer(_config(run_dir, "--logging.interval=2", steps=4, dp=2))
    logged: list[dict[str, float]] = []
    tr.subscribe(MetricsLogged, lambda e: logged.append(dict(e.metrics)))
    tr.fit()
    summary = tr.run_summary.summary(tr.totals())
    tr.close()
    return logged, summary.stragglers


def test_a_slow_rank_is_named_over_gloo(tmp_path):
    for logged, stragglers in run_distributed(_straggler_run, 2, str(tmp_path)):
        assert len(logged) == 2
        for m in logged:
            assert m["straggler_rank"] == 1.0 and m["straggler_flagged"] == 1.0
            assert 0.1 < m["straggler_lag_s"] < 1.0  # ~0.2 s per step
        assert list(stragglers) == ["1"] and stragglers["1"]["intervals"] == 2


# ---------------------------------------------------------------------------------------- watchdog
class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _watchdog(clock: _Clock, *, step_s: float = 120.0, sync_every: int = 1, **cfg: object) -> tuple:
    timeouts = TimeoutConfig(step_s=step_s, watchdog=WatchdogConfig(**cfg))  # type: ignore[arg-type]
    bus = EventBus()
    wd = StepWatchdog(timeouts, bus, sync_every=sync_every, enabled=False, clock=clock)
    wd.start()  # watches (no thread: enabled=False); check() is called by hand
    return wd, bus


def _steps(wd: StepWatchdog, clock: _Clock, first: int, n: int, seconds: float) -> None:
    for s in range(first, first + n):
        wd.step_started(s)
        clock.t += seconds
        assert wd.check() is None
        wd.step_ended(s + 1)


def test_watchdog_limits_follow_warm_up_then_the_step_time():
    clock = _Clock()
    wd, _ = _watchdog(clock, warmup_steps=2, warmup_step_s=50, min_step_s=5, step_factor=10)
    wd.step_started(0)
    assert wd.step_limit()[0] == 50
    clock.t += 49
    assert wd.check() is None
    wd.step_ended(1)
    _steps(wd, clock, 1, 2, 1.0)  # step 1 ends the warm-up steps; step 2 is the first timed one
    assert wd.step_limit() == (10.0, pytest.approx(wd.step_limit()[1]))
    wd.step_started(3)
    wd.set_phase("optimizer")
    clock.t += 10.5
    msg = wd.check()
    assert (
        msg is not None and "step 3" in msg and "'optimizer'" in msg and f"status {WATCHDOG_EXIT_CODE}" in msg
    )
    assert "10x the longest recent step" in msg


def test_watchdog_waits_for_a_synchronised_step_and_stays_below_the_collective_timeout():
    clock = _Clock()
    wd, _ = _watchdog(
        clock, warmup_steps=0, warmup_step_s=20, min_step_s=1, step_factor=10, sync_every=4, step_s=30
    )
    _steps(wd, clock, 0, 3, 0.01)  # the host runs ahead: three quick steps, still warming up
    assert "warm-up" in wd.step_limit()[1]
    _steps(wd, clock, 3, 1, 3.0)  # the synchronising step waits for the device
    limit, why = wd.step_limit()
    assert (
        limit == pytest.approx(0.9 * 30) and "timeouts.step_s=30" in why
    )  # 10 x 2.5 s  = 30 s, capped at 27 s


def test_watchdog_checkpoint_and_evaluation_have_their_own_limits():
    clock = _Clock()
    wd, _ = _watchdog(clock, warmup_steps=0, min_step_s=2, checkpoint_s=100, evaluation_s=40)
    _steps(wd, clock, 0, 1, 0.1)
    with wd.phase("checkpoint", 1):
        clock.t += 99
        assert wd.check() is None
    with wd.phase("evaluation", 1):
        clock.t += 41
        msg = wd.check()
        assert msg is not None and "'evaluation'" in msg and "timeouts.watchdog.evaluation_s=40" in msg
    wd.step_started(1)
    wd.step_ended(2)  # the time of a save or evaluation inside a step is not its step time
    wd.step_started(2)
    with wd.phase("evaluation", 2):
        clock.t += 30
    wd.step_ended(3)
    assert max(wd._durations) < 1 and wd.check() is None
    wd.stop()
    clock.t += 1e6
    assert wd.check() is None  # stopped: nothing is watched


def test_watchdog_enabled_auto_follows_torchrun():
    assert watchdog_enabled(WatchdogConfig(), {"TORCHELASTIC_RUN_ID": "x"})
    assert not watchdog_enabled(WatchdogConfig(), {})
    assert watchdog_enabled(WatchdogConfig(enabled=True), {})


def test_watchdog_config_errors_name_the_field():
    with pytest.raises(ConfigError, match=r"timeouts\.watchdog\.step_factor"):
        load_config(overrides=["--timeouts.watchdog.step_factor=0.5"])
    cfg = load_config(overrides=["--timeouts.watchdog.enabled=false", "--logging.straggler_threshold=null"])
    assert cfg.timeouts.watchdog.enabled is False and cfg.logging.straggler_threshold is None


def test_flight_recorder_adapter():
    # the one private torch API of the package: it must exist wherever torch has NCCL
    if torch.distributed.is_nccl_available():
        assert callable(nccl_trace_dumper()), (
            "torch moved _dump_nccl_trace: update resilience/flight_recorder.py"
        )
    assert dump_nccl_flight_recorder(Path("."), 0) is None  # no NCCL group here: nothing written
    assert callable(getattr(dist.distributed_c10d, "_get_default_store", None)), (
        "torch moved _get_default_store: update resilience/flight_recorder.py (the progress beacons' store)"
    )


def _hang_at_step(run_dir: str, hang_step: int) -> None:
    """A tiny run whose step ``hang_step`` hangs before its optimizer step (a BeforeOptimizerStep subscriber
    that sleeps for an hour): the watchdog must end the process."""
    cfg = _config(
        run_dir,
        "--timeouts.watchdog.enabled=true",
        "--timeouts.watchdog.warmup_steps=1",
        "--timeouts.watchdog.min_step_s=1",
        "--timeouts.watchdog.step_factor=2",  # 1 s unless a step took over 0.5 s (a loaded machine)
        steps=50,
    )
    tr = _trainer(cfg)

    def hang(e: BeforeOptimizerStep) -> None:
        if e.step == hang_step:
            print(f"hanging in step {e.step}", file=sys.stderr, flush=True)
            time.sleep(3600)

    tr.subscribe(BeforeOptimizerStep, hang)
    tr.fit()


def test_a_hung_step_exits_with_the_watchdog_status(tmp_path):
    # A forked child (torch is imported already: no second start-up) with its stderr in a file.
    err = tmp_path / "stderr.txt"
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            fd = os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            sys.stdout = sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
            torch.set_num_threads(1)
            _hang_at_step(str(tmp_path / "run"), 3)
        finally:
            os._exit(1)
    deadline = time.monotonic() + 120
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail(f"the watchdog did not end the hung child: {err.read_text()[-3000:]}")
    out = err.read_text()
    assert os.waitstatus_to_exitcode(done[1]) == WATCHDOG_EXIT_CODE, out[-3000:]
    assert "hanging in step 3" in out and "step watchdog: rank 0 made no progress" in out
    found = re.search(
        r"made no progress for ([0-9.]+) s in step 3, phase 'optimizer' \(limit ([0-9.]+) s", out
    )
    assert found is not None, out[-3000:]
    seconds, limit = float(found.group(1)), float(found.group(2))
    assert (
        1.0 <= limit < 30 and limit <= seconds < limit + 5
    )  # the limit (both printed to 0.1 s), one poll (0.1 s), slack for a busy machine
    assert "plait-step-watchdog" in out or "Current thread" in out  # the stacks of all threads were dumped
    record = json.loads((tmp_path / "run" / "watchdog_rank0.json").read_text())
    assert (record["rank"], record["step"], record["phase"]) == (0, 3, "optimizer")


# ---------------------------------------------------------------------------------------- what a rank waits for
_SITE = "/venv/lib/python3.11/site-packages/torch"


def _frame(path: str, name: str, line: int, back: object = None, **local_vars: object) -> SimpleNamespace:
    """A stand-in for a frame: what find_collective reads of one."""
    code = SimpleNamespace(co_filename=path, co_name=name)
    return SimpleNamespace(f_code=code, f_lineno=line, f_locals=local_vars, f_back=back)


def test_find_collective_walks_out_to_the_innermost_torch_collective_and_its_caller():
    host = SimpleNamespace(group_name="3", group_desc="host")  # not a real group: its ranks are unknown
    fit = _frame("/repo/packages/loop/src/plait/loop/trainer.py", "fit", 600)
    grads = _frame(
        "/repo/packages/loop/src/plait/loop/grads.py", "all_reduce_plain_grads", 60, fit
    )  # not torch
    caller = _frame("/repo/packages/loop/src/plait/loop/trainer.py", "_sum_over_dp", 547, grads)
    wrapper = _frame(f"{_SITE}/distributed/c10d_logger.py", "wrapper", 81, caller)  # torch, not a collective
    reduce = _frame(f"{_SITE}/distributed/distributed_c10d.py", "all_reduce", 4150, wrapper, group=host)
    inner = _frame(f"{_SITE}/distributed/distributed_c10d.py", "_check_single_tensor", 900, reduce)
    found = find_collective(inner, "MainThread")  # type: ignore[arg-type]
    assert found == CollectiveWait(
        name="all_reduce",
        where="torch/distributed/distributed_c10d.py:4150",
        caller="plait/loop/trainer.py:547 in _sum_over_dp",
        thread="MainThread",
        group="group 'host'",
        ranks=None,
    )
    assert found.describe(1) == (
        "rank 1 waits in all_reduce (torch/distributed/distributed_c10d.py:4150) over group 'host', "
        "called from plait/loop/trainer.py:547 in _sum_over_dp"
    )
    # the innermost one wins; no group local: the group is not named; a `group=None` is the default group
    unshard = _frame(
        f"{_SITE}/distributed/fsdp/_fully_shard/_fsdp_param_group.py", "wait_for_unshard", 505, reduce
    )
    found = find_collective(unshard, "worker")  # type: ignore[arg-type]
    assert found is not None and (found.name, found.group, found.thread) == (
        "wait_for_unshard",
        None,
        "worker",
    )
    assert "rank 0's thread 'worker' waits in wait_for_unshard" in found.describe(0)
    barrier = _frame(f"{_SITE}/distributed/distributed_c10d.py", "barrier", 4800, caller, group=None)
    found = find_collective(barrier)  # type: ignore[arg-type]
    assert found is not None and (found.name, found.group) == ("barrier", "the default group")
    # no collective: plait's own all_reduce helper, torch outside torch.distributed, torchrun's agent
    agent = _frame(f"{_SITE}/distributed/elastic/multiprocessing/api.py", "wait", 595, grads)
    matmul = _frame(f"{_SITE}/nn/functional.py", "linear", 100, agent)
    assert find_collective(matmul) is None  # type: ignore[arg-type]
    assert find_collective(None) is None


def _beacon(
    step: int, phase: str, *, since: float = 90.0, at: float = 99.5, collective: str | None = None
) -> Beacon:
    return Beacon(step, phase, since, collective, at)


def test_the_stuck_ranks_are_named_from_their_beacons():
    here = dict(rank=1, world_size=6, step=7, phase="grad_clip", collective="all_reduce", now=100.0)
    beacons = {
        0: _beacon(7, "forward_backward"),  # behind
        1: _beacon(7, "grad_clip", collective="all_reduce"),  # this rank
        2: _beacon(7, "data", at=80.0),  # frozen: its beacon is 20 s old
        3: _beacon(7, "grad_clip", collective="all_reduce"),  # waits with this rank
        4: _beacon(7, "grad_clip"),  # where this rank is, but in no collective
        # 5: no beacon at all
    }
    ranks, text = name_stuck_ranks(beacons, **here)  # type: ignore[arg-type]
    assert ranks == [0, 2, 4, 5]
    assert "rank 0 is stuck: at step 7, phase 'forward_backward' for 10.0 s, behind this rank" in text
    assert "rank 2 is stuck: last seen at step 7, phase 'data', 20.0 s ago (frozen or dead)" in text
    assert (
        "rank 4 is stuck: at step 7, phase 'grad_clip' for 10.0 s, in no collective while this rank" in text
    )
    assert "rank 5 is stuck: it published no progress" in text
    assert text.endswith("this rank (1) waits at step 7, phase 'grad_clip'") and "rank 3" not in text
    # ahead of this rank, or out of the loop
    beacons = {0: _beacon(8, "data"), 2: _beacon(7, "idle", since=95.0)}
    ranks, text = name_stuck_ranks(beacons, **{**here, "world_size": 3})  # type: ignore[arg-type]
    assert ranks == [2] and "rank 2 is stuck: out of its training loop (step 7) for 5.0 s" in text
    ranks, text = name_stuck_ranks(
        {0: _beacon(7, "grad_clip")}, **{**here, "world_size": 2, "collective": None}
    )  # type: ignore[arg-type]
    assert ranks == [] and text.startswith("no other rank is behind this one or silent")
    # the store does not answer: its server runs in rank 0's process, which is frozen or dead
    ranks, text = name_stuck_ranks(None, **here, store_problem="did not answer within 2 s", store_host=0)  # type: ignore[arg-type]
    assert ranks == [0] and text.startswith(
        "rank 0 is stuck: the store its process serves did not answer within 2 s (frozen or dead)"
    )
    ranks, text = name_stuck_ranks(None, **here, store_problem="did not answer within 2 s", store_host=None)  # type: ignore[arg-type]
    assert ranks == [] and "progress is unknown" in text


def _wait_for_a_stuck_peer(run_dir: str) -> dict | None:
    """Rank 0 stops in step 7's forward-backward (until rank 1's watchdog fired); rank 1 goes on to the
    grad clip's all-reduce and waits there for it. Rank 1's watchdog (1 s) names rank 0 and the all-reduce."""
    rank = dist.get_rank()
    store = dist.PrefixStore("test_resilience", default_store())  # type: ignore[arg-type]
    fired: list[str] = []

    def expire(message: str) -> None:
        fired.append(message)
        store.set("fired", "1")

    limit = 1.0 if rank == 1 else 600.0
    timeouts = TimeoutConfig(watchdog=WatchdogConfig(warmup_step_s=limit))
    wd = StepWatchdog(
        timeouts, EventBus(), rank=rank, run_dir=Path(run_dir), enabled=True, on_expire=expire, poll_s=0.05
    )
    wd.start()
    dist.barrier()  # both beacons are out
    wd.step_started(7)
    wd.set_phase("forward_backward")
    if rank == 0:
        store.wait(["fired"], timedelta(seconds=60))
    else:
        wd.set_phase("grad_clip")
    dist.all_reduce(torch.ones(1))  # rank 1 waits here for rank 0
    wd.stop()
    if rank == 0:
        return None
    return {
        "fired": fired,
        "stuck_ranks": wd.stuck_ranks,
        "collective": wd.collective.record() if wd.collective else None,
    }


def test_a_waiting_rank_names_the_stuck_rank_and_the_collective_over_gloo(tmp_path):
    _, seen = run_distributed(_wait_for_a_stuck_peer, 2, str(tmp_path))
    assert seen is not None and len(seen["fired"]) == 1
    lines = seen["fired"][0].splitlines()
    assert lines[0].startswith("step watchdog: rank 1 made no progress") and len(lines) == 3, lines
    assert re.fullmatch(
        r"step watchdog: rank 0 is stuck: at step 7, phase 'forward_backward' for [0-9.]+ s, behind this rank; "
        r"this rank \(1\) waits at step 7, phase 'grad_clip'",
        lines[1],
    ), lines[1]
    assert re.fullmatch(
        r"step watchdog: rank 1 waits in all_reduce \(torch/distributed/distributed_c10d.py:\d+\) over the "
        r"default group \(ranks \[0, 1\]\), called from tests/loop/test_resilience.py:\d+ in _wait_for_a_stuck_peer",
        lines[2],
    ), lines[2]
    assert seen["stuck_ranks"] == [0]
    assert seen["collective"]["name"] == "all_reduce" and seen["collective"]["ranks"] == [0, 1]


def test_no_collective_on_a_quiet_stack():
    assert collective_wait() is None  # pytest's threads wait in no torch.distributed call
