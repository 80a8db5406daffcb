"""A full disk during a save: one error naming the checkpoint, its directory, ``No space left on
device`` and the checkpoint kept; the partial one removed; the summary does not fail a second time.

Runs on a small tmpfs, which needs the permission to mount (root); skipped where mounting is refused.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from plait.loop import StepEnd
from plait.loop.checkpoint import CheckpointWriteError

from tests.loop.test_divergence import _trainer


@pytest.fixture
def small_disk(tmp_path: Path):
    mount = tmp_path / "disk"
    mount.mkdir()
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], capture_output=True, text=True
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)


def _fill(disk: Path) -> None:
    fd = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        while os.write(fd, b"\0" * 4096):
            pass
    except OSError:  # No space left on device: full
        pass
    finally:
        os.close(fd)


@pytest.mark.parametrize("mode", ["off", "thread"])
def test_full_disk_during_a_save_is_one_clear_error(small_disk: Path, mode: str, capsys) -> None:
    run_dir = small_disk / "run"
    tr = _trainer(
        run_dir, 3, "--checkpoint.enabled=true", "--checkpoint.interval=1", f"--checkpoint.async_mode={mode}"
    )
    kept = run_dir / "checkpoints" / "step_00000001"

    def fill_after_checkpoint_1(e: StepEnd) -> None:
        if e.step == 2:  # before the save of step 2
            assert tr.checkpointer is not None and tr.checkpointer.finalize() in (None, kept)
            _fill(small_disk)

    tr.subscribe(StepEnd, fill_after_checkpoint_1)
    with pytest.raises(CheckpointWriteError) as err:
        tr.fit()
    tr.close()  # finalises nothing more; the summary cannot be written but says so instead of raising
    msg = str(err.value)
    assert msg.startswith("checkpoint step 2 could not be written to ")
    assert str(run_dir / "checkpoints" / ".step_00000002.partial") in msg and "No space left on device" in msg
    assert msg.endswith(f"the newest complete checkpoint, {kept}, is kept")
    assert len(msg.splitlines()) == 1 and err.value.__cause__ is None and err.value.__suppress_context__
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_00000001"]
    out = capsys.readouterr().out
    # async: the failed write is seen when the save is next polled, after the step that follows it at most
    assert (
        "run FAILED: step 2/3" in out or mode != "off"
    ) and "error: CheckpointWriteError: checkpoint step 2" in out
    assert "summary not written" in out and "No space left on device" in out
