"""A run that heals itself under torchrun: 2 CPU ranks (gloo), one hangs after a checkpoint, the step
watchdog ends the group with status 75, ``torchrun --max-restarts 1`` restarts it, the new group resumes
from the newest complete checkpoint and finishes with exit status 0.

The hang is ``PLAIT_DEBUG_RANK_HANG`` (first attempt only). torchrun runs with ``--standalone`` and no
special environment: its agent serves one store to every restart, and each attempt's process group lives
under a prefix of its own in it (``DistributedContext.from_env``; see the loop README, "Runs that heal
themselves").
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e._pretrain_runner import REPO

pytestmark = [pytest.mark.slow, pytest.mark.timeout(480)]

STEPS = 10
HANG_STEP = 7  # the hang starts after 7 completed steps: checkpoints 2 and 4 (6 perhaps) are complete
ARGS = [
    "--mesh.data_shard=2",
    "--batching.seq_len=32",
    "--batching.global_batch_size=4",
    "--batching.microbatch_size=2",
    "--data.max_files=8",
    "--data.validation_files=1",
    "--evaluation.enabled=false",
    "--logging.progress_bar=false",
    "--logging.interval=1",
    "--checkpoint.enabled=true",
    "--checkpoint.interval=2",
    "--no-export",
    # a hang is seen after 10 s (5x the longest recent step, at least 10 s) instead of minutes
    "--timeouts.watchdog.warmup_steps=1",
    "--timeouts.watchdog.warmup_step_s=300",
    "--timeouts.watchdog.min_step_s=10",
    "--timeouts.watchdog.step_factor=5",
]
TIMEOUT_S = 420


def _torchrun(run_dir: Path, hang: str) -> tuple[int, str]:
    """``torchrun --nproc-per-node 2 --max-restarts 1 -m plait train`` with ``PLAIT_DEBUG_RANK_HANG=hang``;
    its exit status and output (the workers' included). Its process group is ended on a timeout."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "--max-restarts", "1", "--monitor-interval", "0.5",
        "-m", "plait", "train", "--steps", str(STEPS), "--run-dir", str(run_dir), *ARGS,
    ]  # fmt: skip
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
        "PLAIT_DEBUG_RANK_HANG": hang,
    }
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # the workers and their checkpoint writers can be ended together
    )
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"torchrun did not finish within {TIMEOUT_S} s:\n{out[-6000:]}") from None
    finally:  # the workers and their checkpoint writers, whatever ended the wait
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, out


def _logged_losses(out: str) -> dict[int, list[str]]:
    """Each step's losses as the main rank logged them, in order (a step redone after the restart twice)."""
    losses: dict[int, list[str]] = {}
    for step, loss in re.findall(rf"INFO step (\d+)/{STEPS} \| loss (\S+)", out):
        losses.setdefault(int(step), []).append(loss)
    return losses


def _check_healed(run_dir: Path, rc: int, out: str, hung_rank: int, how: str) -> None:
    tail = out[-8000:]
    assert rc == 0, tail
    # first attempt: the rank hung after a checkpoint, a watchdog ended its rank with 75 and named the phase
    assert f"[rank {hung_rank}] PLAIT_DEBUG_RANK_HANG: {how} in step {HANG_STEP}" in out, tail
    fired = re.findall(
        rf"step watchdog: rank (\d) made no progress for \S+ s in step {HANG_STEP}, phase '(\w+)'", out
    )
    assert fired, tail
    assert all(
        phase in ("data", "forward_backward", "grad_clip", "optimizer", "metrics") for _, phase in fired
    )
    assert re.search(r"failed \(exitcode: 75\)", out), tail
    # second attempt: resumed from a checkpoint the first one completed, and finished the run
    resumed = re.findall(r"resumed from (\S+)/step_(\d+) \(step (\d+), saved by 2 ranks\)", out)
    assert resumed, tail
    resumed_step = int(resumed[0][2])
    assert 2 <= resumed_step <= HANG_STEP and resumed_step % 2 == 0, resumed
    assert f"checkpoint step {resumed_step} complete" in out.split("PLAIT_DEBUG_RANK_HANG")[0], tail
    assert f"run finished: step {STEPS}/{STEPS} ({STEPS - resumed_step} this session)" in out, tail
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["steps_this_session"] == STEPS - resumed_step, summary
    assert summary["error"] is None, summary
    assert (run_dir / "checkpoints" / f"step_{STEPS:08d}").is_dir()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    assert [r["step"] for r in records if "loss" in r] == list(range(1, STEPS + 1))
    # the steps redone after the resume repeat the first attempt's losses: the state was restored
    losses = _logged_losses(out)
    redone = [s for s in range(resumed_step + 1, HANG_STEP + 1)]
    assert redone and all(len(losses[s]) == 2 and losses[s][0] == losses[s][1] for s in redone), losses
    assert not list(run_dir.glob("watchdog_rank*.json")), "the restarted ranks remove the watchdog's records"


def test_a_stopped_rank_is_ended_by_the_others_watchdog_and_restarted(tmp_path):
    """Rank 0 is frozen with SIGSTOP (its own watchdog is frozen too) and never continued: rank 1's watchdog
    names rank 0 and the collective rank 1 waits in and ends rank 1 with 75, torchrun kills the stopped rank
    (SIGTERM waits for SIGCONT; SIGKILL after 30 s) and restarts both, which resume from the newest complete
    checkpoint and finish the run. (A rank that hangs while its process runs, ``PLAIT_DEBUG_RANK_HANG=1:7``,
    heals the same way: its own watchdog fires.)"""
    run_dir = tmp_path / "run"
    rc, out = _torchrun(run_dir, f"0:{HANG_STEP}:stop")
    _check_healed(run_dir, rc, out, hung_rank=0, how="stopping (SIGSTOP)")
    first = out.split("resumed from")[0]
    assert "step watchdog: rank 1 made no progress" in first
    assert "step watchdog: rank 0 made no progress" not in first
    # rank 1 names the stopped rank (its beacon went silent, or the store its process serves does not
    # answer) and the collective it waits in: the step's token count, over both ranks
    stuck = re.search(r"step watchdog: rank 0 is stuck: ([^\n]*)", first)
    assert stuck is not None, first[-8000:]
    assert re.match(
        r"(last seen at step \d+, phase '\w+'[^;]*\(frozen or dead\)|the store its process serves did not answer)",
        stuck.group(1),
    ), stuck.group(0)
    assert f"this rank (1) waits at step {HANG_STEP}, phase 'data'" in stuck.group(1), stuck.group(0)
    assert re.search(
        r"step watchdog: rank 1 waits in all_reduce \(torch/distributed/\S+\) over the default group "
        r"\(ranks \[0, 1\]\), called from plait/loop/trainer.py:\d+ in _sum_over_dp",
        first,
    ), first[-8000:]
