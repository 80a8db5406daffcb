"""Ctrl-C under ``uv run``: the terminal's SIGINT to the process group, then uv's forwarded copy about
200 ms later. The main job takes both as one stop: it saves the step, writes its summary and exits 130
without a traceback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

from tests.e2e._pretrain_runner import REPO, TRAIN_CMD

ARGS = [
    "--batching.seq_len=32",
    "--batching.global_batch_size=4",
    "--batching.microbatch_size=4",
    "--data.max_files=8",
    "--data.validation_files=1",
    "--evaluation.enabled=false",
    "--logging.progress_bar=false",
    "--logging.interval=1",
    "--checkpoint.interval=1000",
    "--no-export",
]


def _start(run_dir) -> tuple[subprocess.Popen[str], list[str], threading.Event, threading.Thread]:
    """The job in a process group of its own (as a terminal's), its stderr collected by a thread (the only
    reader of that pipe); the event is set once it has logged a training step."""
    proc = subprocess.Popen(
        [*TRAIN_CMD, "--steps", "100000", "--run-dir", str(run_dir), *ARGS],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    lines: list[str] = []
    training = threading.Event()

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            if " step 2/" in line:
                training.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    return proc, lines, training, reader


def _wait_for_spawned_child(pid: int, timeout: float = 120.0) -> None:
    """Until the job has spawned a child (DCP's checkpoint writer, started by a background thread after the
    first step). The signals then come while that child is still starting (reading the job's script,
    importing torch): a child that died of them there would take the final save with it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
            if any(b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes() for c in children):
                return
        except FileNotFoundError:  # a child that exited between the listing and the read
            pass
        time.sleep(0.05)
    raise AssertionError(f"the job spawned no process within {timeout} s")


def test_two_sigints_200ms_apart_save_summarise_and_exit_130(tmp_path):
    run_dir = tmp_path / "run"
    proc, err, training, reader = _start(run_dir)
    try:
        assert training.wait(120), "".join(err)
        _wait_for_spawned_child(proc.pid)
        os.killpg(proc.pid, signal.SIGINT)  # the terminal: every process of the group
        time.sleep(0.2)
        proc.send_signal(signal.SIGINT)  # uv's forwarded copy
        proc.wait(timeout=120)
        out = proc.stdout.read()  # a few lines: the pipe never filled
        reader.join(timeout=10)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    stderr = "".join(err)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr, stderr
    # the signal's log line whole, on a line of its own (not lost in, or glued to, the line being written);
    # Python may run the handler once for both signals (a repeat before the handler ran is not seen)
    assert sum(line.rstrip("\n").endswith("again after 2 s: abort)") for line in err) == 1, stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stopped_early"] and summary["steps"] >= 2
    assert summary["checkpoint"] and summary["checkpoint"].endswith(f"step_{summary['steps']:08d}")
    assert "run stopped early" in out
