"""One job per run directory: a second run refuses naming the holder; a killed holder's lock is taken
over and reported; every exit path releases it; trainers of one process share it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from plait.loop.run_lock import LOCK_NAME, lock_run_dir

REPO = Path(__file__).resolve().parents[2]


def _run(run_dir: Path, steps: int, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.loop._run_script", str(run_dir), str(steps), *extra],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


LOCK_MODULE = REPO / "packages" / "loop" / "src" / "plait" / "loop" / "run_lock.py"


def _probe(run_dir: Path) -> list[str]:
    """A process that takes the lock of ``run_dir``, logging, and exits (non-zero when refused); it
    loads the lock's module alone (standard library only), without torch, so it starts at once."""
    code = (
        "import importlib.util, logging; logging.basicConfig()\n"
        f"spec = importlib.util.spec_from_file_location('run_lock', {str(LOCK_MODULE)!r})\n"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
        f"m.lock_run_dir({str(run_dir)!r})"
    )
    return [sys.executable, "-c", code]


def test_two_runs_on_one_run_dir(tmp_path: Path) -> None:
    first = _run(tmp_path, 10_000, "--sleep", "0.05")
    try:
        assert first.stdout is not None and first.stdout.readline().strip() == "training"
        second = _run(tmp_path, 2)
        _, err = second.communicate(timeout=300)
        assert second.returncode != 0
        assert f"RunDirLockedError: run directory {tmp_path.resolve()} is in use by pid {first.pid}" in err
        assert first.poll() is None  # the holder trains on
    finally:
        first.send_signal(signal.SIGKILL)  # no chance to release: the kernel drops the flock
        first.wait(timeout=60)
    holder = json.loads((tmp_path / LOCK_NAME).read_text())
    assert holder["pid"] == first.pid  # the dead holder's record is still there
    third = subprocess.run(_probe(tmp_path), capture_output=True, text=True, timeout=120)
    assert third.returncode == 0, third.stderr
    assert f"taking over the lock of pid {first.pid} on host" in third.stderr


def test_a_finished_run_releases_the_lock(tmp_path: Path) -> None:
    from tests.loop._run_script import main

    main([str(tmp_path), "2"])
    assert (tmp_path / LOCK_NAME).read_text() == ""  # emptied at close
    taken = subprocess.run(_probe(tmp_path), capture_output=True, text=True, timeout=120)
    assert taken.returncode == 0 and "taking over" not in taken.stderr, taken.stderr


def test_lock_is_shared_in_a_process_and_released_by_every_holder(tmp_path: Path) -> None:
    a = lock_run_dir(tmp_path)
    b = lock_run_dir(tmp_path)  # a second trainer of this process (train, then resume)
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    probe = _probe(tmp_path)
    a.release()
    a.release()  # idempotent
    refused = subprocess.run(probe, capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and f"in use by pid {os.getpid()} on host" in refused.stderr
    del b  # garbage collection releases the last share
    taken = subprocess.run(probe, capture_output=True, text=True, timeout=120)
    assert taken.returncode == 0, taken.stderr


def test_a_failed_trainer_construction_releases_the_lock(tmp_path: Path) -> None:
    from plait.loop import CausalLMTask, DatasetProvider, ModuleProvider, Trainer, load_config

    from tests.loop._lm import TinyLM

    def broken() -> None:
        raise RuntimeError("no data here")

    cfg = load_config(overrides=[f"--run.run_dir={tmp_path}", "--logging.progress_bar=false"])
    with pytest.raises(RuntimeError, match="no data here"):
        Trainer(cfg, ModuleProvider(TinyLM), DatasetProvider(broken), CausalLMTask())
    taken = subprocess.run(_probe(tmp_path), capture_output=True, text=True, timeout=120)
    assert taken.returncode == 0, taken.stderr
