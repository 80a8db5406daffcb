"""Checkpoint hardening: prompt completion, reserved staging buffers, damaged checkpoints named and
skipped, no code of a checkpoint's run on load, the writer process opening no socket on every interface."""

from __future__ import annotations

import json
import logging
import os
import pickle
import re
import socket
import subprocess
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from plait.loop import (
    CausalLMTask,
    DatasetProvider,
    ModuleProvider,
    StepEnd,
    Trainer,
    load_config,
    pack_documents,
)
from plait.loop.checkpoint import (
    CheckpointDamagedError,
    Checkpointer,
    ModelState,
    OptimizerState,
    PerRankState,
    RngState,
    UnsafeCheckpointError,
    ValueState,
    _codec,
    export_checkpoint,
)
from plait.loop.metrics import MetricCollection
from torch import nn

from tests.loop._lm import VOCAB, TinyLM, pattern_tokens

HERE = Path(__file__).parent


def _setup(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()  # the optimizer's moments exist
    opt.zero_grad()
    return model, opt


def _state(model, opt, step=0):
    return {
        "model": ModelState(model),
        "optim": OptimizerState(model, opt),
        "rng": RngState(),
        "step": ValueState(step),
    }


def _trainer(run_dir, steps: int, *extra: str) -> Trainer:
    cfg = load_config(
        overrides=[
            f"--run.run_dir={run_dir}",
            f"--run.steps={steps}",
            "--batching.global_batch_size=4",
            "--batching.microbatch_size=2",
            "--batching.seq_len=16",
            "--logging.progress_bar=false",
            "--checkpoint.enabled=true",
            "--checkpoint.async_mode=thread",
            *extra,
        ]
    )
    data = DatasetProvider(pack_documents(pattern_tokens(), 16, eos_id=VOCAB - 1))
    return Trainer(cfg, ModuleProvider(TinyLM), data, CausalLMTask())


# -- a checkpoint is complete promptly; its staging buffers are allocated ahead of it ----------
def test_async_checkpoint_is_complete_before_two_more_steps_end(tmp_path):
    """Step k's async save is finalised by the trainer's poll at a later step end, not when the next save
    starts (k + interval) or at exit: at the end of step k + 2 it is complete on disk."""
    tr = _trainer(tmp_path, 12, "--checkpoint.interval=4", "--checkpoint.keep_last=5")
    complete_at: dict[int, bool] = {}

    def on_step_end(e: StepEnd) -> None:
        if e.step in (6, 10):  # saves started at steps 4 and 8
            marker = tmp_path / "checkpoints" / f"step_{e.step - 2:08d}" / "plait_checkpoint.json"
            complete_at[e.step] = marker.is_file()
        time.sleep(0.3)  # a CPU step of the real job takes longer than this toy's write

    tr.subscribe(StepEnd, on_step_end)
    tr.fit()
    tr.close()
    assert complete_at == {6: True, 10: True}


def test_reserve_allocates_the_staging_buffers_the_first_save_uses(tmp_path):
    model, opt = _setup()
    ck = Checkpointer(tmp_path, async_mode="thread")
    state = _state(model, opt)
    ck.reserve(state)
    assert ck.staging is not None
    ck.staging.wait_reserved()
    assert ck.staging is not None and ck.staging.stager is not None
    cache = ck.staging.stager.cached_buffers()
    tensors = [model[0].weight, model[2].bias, *(v for s in opt.state.values() for v in s.values())]
    reserved = {id(t): cache[t.untyped_storage()].data_ptr() for t in tensors}
    ck.save(1, state)
    ck.wait_for_staging()
    staged = {id(t): cache[t.untyped_storage()].data_ptr() for t in tensors}
    assert staged == reserved  # the first save copied into the reserved buffers, allocated nothing new
    ck.close()
    fresh, fresh_opt = _setup(seed=7)
    Checkpointer(tmp_path).load(tmp_path / "step_00000001", _state(fresh, fresh_opt))
    assert torch.equal(fresh[0].weight, model[0].weight)


# -- a damaged checkpoint is named; the previous complete one is used, or the run stops ----------
def _two_checkpoints(root: Path, **kw):
    model, opt = _setup()
    ck = Checkpointer(root, async_mode="off", **kw)
    ck.save(1, _state(model, opt, 1))
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    ck.save(2, _state(model, opt, 2))
    data = sorted((root / "step_00000002").glob("*.distcp"))[0]
    return ck, data


def test_marker_records_file_sizes_and_checksums(tmp_path):
    _two_checkpoints(tmp_path, checksums=True)
    files = json.loads((tmp_path / "step_00000002" / "plait_checkpoint.json").read_text())["files"]
    on_disk = {p.name: p for p in (tmp_path / "step_00000002").iterdir() if p.name != "plait_checkpoint.json"}
    assert sorted(files) == sorted(on_disk)

    for name, rec in files.items():
        raw = on_disk[name].read_bytes()
        assert rec == {"size": len(raw), "crc32": zlib.crc32(raw)}


def test_truncated_data_file_falls_back_to_the_previous_checkpoint(tmp_path, caplog):
    ck, data = _two_checkpoints(tmp_path)
    data.write_bytes(data.read_bytes()[:100])
    with caplog.at_level(logging.WARNING):
        assert ck.latest() == tmp_path / "step_00000001"
    assert (
        "step_00000002 is damaged" in caplog.text and data.name in caplog.text and "truncated" in caplog.text
    )
    stop = Checkpointer(tmp_path, async_mode="off", on_damaged="stop")
    with pytest.raises(
        CheckpointDamagedError, match=rf"step_00000002 is damaged: file {data.name} has 100 bytes"
    ):
        stop.latest()


@pytest.mark.parametrize("files", ["absent", "empty"])
def test_a_marker_without_a_file_list_is_damaged(tmp_path, caplog, files):
    ck, _ = _two_checkpoints(tmp_path)
    marker = tmp_path / "step_00000002" / "plait_checkpoint.json"
    meta = json.loads(marker.read_text())
    if files == "absent":
        del meta["files"]
    else:
        meta["files"] = {}
    marker.write_text(json.dumps(meta))
    with caplog.at_level(logging.WARNING):
        assert ck.latest() == tmp_path / "step_00000001"
    assert "step_00000002 is damaged: its marker plait_checkpoint.json lists no files" in caplog.text
    stop = Checkpointer(tmp_path, async_mode="off", on_damaged="stop")
    with pytest.raises(
        CheckpointDamagedError, match=r"step_00000002 is damaged: its marker .* lists no files"
    ):
        stop.latest()


def test_corrupt_data_file_is_caught_by_checksum_or_at_load(tmp_path, caplog):
    ck, data = _two_checkpoints(tmp_path, checksums=True)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2 :] = bytes(len(raw) - len(raw) // 2)  # same size, zeroed second half
    data.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING):
        assert ck.latest() == tmp_path / "step_00000001"
    assert f"file {data.name} does not match its recorded CRC32" in caplog.text
    # Without checksums the sizes match; loading fails and resume() falls back, naming the checkpoint.
    plain = Checkpointer(tmp_path, async_mode="off")
    assert plain.latest() == tmp_path / "step_00000002"
    fresh, fresh_opt = _setup(seed=3)
    state = _state(fresh, fresh_opt)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        path, meta = plain.resume(state)
    assert path == tmp_path / "step_00000001" and meta["step"] == 1 and state["step"].value == 1
    assert "checkpoint" in caplog.text and "step_00000002 cannot be read" in caplog.text
    with pytest.raises(CheckpointDamagedError, match="step_00000002 cannot be read"):
        Checkpointer(tmp_path, async_mode="off", on_damaged="stop").resume(_state(fresh, fresh_opt))


def test_trainer_resumes_from_the_previous_checkpoint_when_the_newest_is_damaged(tmp_path):
    tr = _trainer(tmp_path, 4, "--checkpoint.interval=2")
    tr.fit()
    tr.close()
    data = sorted((tmp_path / "checkpoints" / "step_00000004").glob("*.distcp"))[0]
    data.write_bytes(data.read_bytes()[:-10])
    tr = _trainer(tmp_path, 4, "--checkpoint.interval=2")
    assert tr.resume() == tmp_path / "checkpoints" / "step_00000002" and tr.step == 2
    tr.close()
    stop = _trainer(tmp_path, 4, "--checkpoint.interval=2", "--checkpoint.on_damaged=stop")
    with pytest.raises(CheckpointDamagedError, match="step_00000004 is damaged"):
        stop.fit()
    stop.close()


# -- loading cannot execute code ------------------------------------------------------------------
class _Plant:
    """Unpickling this runs ``os.mkdir(path)``."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.mkdir, (self.path,))


class _RawBlob:
    """A Stateful writing the given bytes where a PerRankState writes its blob."""

    def __init__(self, blob: bytes) -> None:
        self.blob = blob

    def state_dict(self):  # type: ignore[no-untyped-def]
        return {"rank0": self.blob}

    def load_state_dict(self, state):  # type: ignore[no-untyped-def]
        self.blob = state["rank0"]


def test_planted_pickle_in_per_rank_state_is_not_executed(tmp_path):
    flag = tmp_path / "pwned"
    Checkpointer(tmp_path / "ck", async_mode="off").save(1, {"metrics": _RawBlob(pickle.dumps(_Plant(flag)))})
    with pytest.raises(CheckpointDamagedError, match=r"'metrics': not a plait per-rank state"):
        Checkpointer(tmp_path / "ck").load(
            tmp_path / "ck" / "step_00000001", {"metrics": PerRankState(MetricCollection())}
        )
    assert not flag.exists()


def test_planted_pickle_in_a_value_is_not_executed(tmp_path):
    flag = tmp_path / "pwned"
    Checkpointer(tmp_path / "ck", async_mode="off").save(1, {"v": ValueState(_Plant(flag))})
    with pytest.raises(CheckpointDamagedError, match=r"step_00000001 cannot be read"):
        Checkpointer(tmp_path / "ck").load(tmp_path / "ck" / "step_00000001", {"v": ValueState(0)})
    assert not flag.exists()


class _System:
    """Unpickling this runs ``os.system(command)``."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.system, (self.command,))


def _plant_metadata(checkpoint: Path, flag: Path) -> Path:
    """Replace the DCP ``.metadata`` of ``checkpoint`` by a pickle running ``touch flag``, and the marker's
    record of it by the planted file's (whoever can write the one can write the other)."""
    metadata = checkpoint / ".metadata"
    metadata.write_bytes(pickle.dumps(_System(f"touch {flag}")))
    marker = checkpoint / "plait_checkpoint.json"
    meta = json.loads(marker.read_text())
    meta["files"][".metadata"] = {"size": metadata.stat().st_size}
    marker.write_text(json.dumps(meta))
    return metadata


def _refused(metadata: Path) -> str:
    return rf"{re.escape(str(metadata))} is refused: its pickle names {os.system.__module__}\.system"


def test_planted_dcp_metadata_is_refused_on_resume_and_export(tmp_path, caplog):
    _two_checkpoints(tmp_path)
    flag = tmp_path / "pwned"
    metadata = _plant_metadata(tmp_path / "step_00000002", flag)
    fresh, fresh_opt = _setup(seed=3)
    with pytest.raises(UnsafeCheckpointError, match=_refused(metadata)):
        Checkpointer(tmp_path, async_mode="off", on_damaged="stop").resume(_state(fresh, fresh_opt))
    with caplog.at_level(logging.WARNING):  # like any damaged checkpoint: named, the previous one used
        resumed = Checkpointer(tmp_path, async_mode="off").resume(_state(fresh, fresh_opt))
    assert resumed is not None and resumed[0] == tmp_path / "step_00000001"
    assert re.search(_refused(metadata), caplog.text)
    with pytest.raises(UnsafeCheckpointError, match=_refused(metadata)):
        export_checkpoint(tmp_path / "step_00000002", fresh, tmp_path / "export")
    assert not flag.exists()


def test_trainer_refuses_a_planted_dcp_metadata(tmp_path):
    tr = _trainer(tmp_path, 2, "--checkpoint.interval=2")
    tr.fit()
    tr.close()
    flag = tmp_path / "pwned"
    metadata = _plant_metadata(tmp_path / "checkpoints" / "step_00000002", flag)
    tr = _trainer(tmp_path, 4, "--checkpoint.interval=2", "--checkpoint.on_damaged=stop")
    with pytest.raises(UnsafeCheckpointError, match=_refused(metadata)):
        tr.fit()
    tr.close()
    assert not flag.exists()


def test_per_rank_state_codec_round_trips_rng_states():
    torch.manual_seed(3)
    np.random.seed(5)
    state = RngState().inner.state_dict()
    back = _codec.decode(_codec.encode(state))
    assert back["python"] == state["python"]
    assert torch.equal(back["torch"], state["torch"]) and back["torch"].dtype == torch.uint8
    assert back["numpy"][0] == state["numpy"][0] and np.array_equal(back["numpy"][1], state["numpy"][1])
    assert back["numpy"][1].dtype == state["numpy"][1].dtype and back["numpy"][2:] == state["numpy"][2:]
    nested = {
        "a": (1, 2.5, None, "s"),
        "b": [torch.zeros(0), torch.arange(6, dtype=torch.bfloat16).view(2, 3)],
    }
    out = _codec.decode(_codec.encode(nested))
    assert out["a"] == nested["a"] and out["b"][0].numel() == 0 and torch.equal(out["b"][1], nested["b"][1])


# -- the async writer process opens no listening socket on every interface ------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.skipif(
    not Path("/proc/self/net/tcp").exists(), reason="reads listening sockets from Linux /proc"
)
@pytest.mark.parametrize("job_store", ["torchrun", "none"])
def test_process_writer_listens_on_no_wildcard_address(tmp_path, job_store):
    """The writer process joins the job's store (torchrun's MASTER_ADDR/PORT) or, in a one-process job
    without one, a store on 127.0.0.1: it opens no store of its own on every interface."""
    port = str(_free_port()) if job_store == "torchrun" else "none"
    proc = subprocess.run(
        [sys.executable, str(HERE / "_process_store_script.py"), str(tmp_path), port],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    listening = json.loads(proc.stdout.strip().splitlines()[-1])
    wildcard = {"0.0.0.0", "0000:0000:0000:0000:0000:0000:0000:0000"}
    assert not [s for s in listening if s[0] in wildcard], listening
    assert (tmp_path / "step_00000001" / "plait_checkpoint.json").is_file()
    # DCP's writer process logs at INFO by itself ("Waiting for checkpoint save request..."): not here
    assert "checkpoint save request" not in proc.stderr and " INFO " not in proc.stderr, proc.stderr[-3000:]


def test_process_mode_of_several_ranks_without_master_address_is_a_clear_error(monkeypatch, tmp_path):
    import plait.loop.checkpoint.checkpointer as checkpointer
    import plait.loop.checkpoint.group as group
    from plait.loop.checkpoint.writer_process import WriterProcess

    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(ValueError, match="async_mode='process' needs MASTER_ADDR and MASTER_PORT"):
        WriterProcess().acquire(world_size=2)
    monkeypatch.setattr(checkpointer, "initialised", lambda: True)
    monkeypatch.setattr(group, "initialised", lambda: True)
    monkeypatch.setattr(group.dist, "get_world_size", lambda group=None: 2)
    writer = WriterProcess()
    with pytest.raises(ValueError, match="async_mode='process' needs MASTER_ADDR and MASTER_PORT"):
        Checkpointer(tmp_path, async_mode="process", writer_process=writer)
    assert writer.users == 0


def test_tensorboard_tracker_purges_the_redone_steps(monkeypatch, tmp_path):
    """A run resumed from step k asks TensorBoard to purge its events of steps > k (``purge_step=k+1``)."""
    import types

    from plait.loop.tracking import trackers

    opened = []

    class Writer:
        def __init__(self, log_dir, purge_step=None):  # type: ignore[no-untyped-def]
            opened.append((log_dir, purge_step))

    monkeypatch.setattr(trackers, "_need", lambda *a: None)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=Writer))
    trackers.build_tracker("tensorboard", tmp_path, start_step=3)
    trackers.build_tracker("tensorboard", tmp_path, start_step=0)
    assert opened == [(str(tmp_path / "tensorboard"), 4), (str(tmp_path / "tensorboard"), None)]


def test_a_crash_while_deleting_an_old_checkpoint_leaves_no_visible_step_without_its_marker(
    tmp_path, monkeypatch
):
    # Rotation deletes old checkpoints. A process killed in the middle of that deletion must not leave a
    # visible step directory without its marker (a reader would find a checkpoint it cannot load).
    from plait.loop.checkpoint import _layout
    from plait.loop.checkpoint.rotation import rotate

    for step in (1, 2):
        d = tmp_path / f"step_{step:08d}"
        d.mkdir()
        (d / "data.distcp").write_bytes(b"x" * 64)
        (d / _layout.MARKER).write_text(json.dumps({"step": step}))

    def killed_midway(path, ignore_errors=False):  # the marker goes first, then the process dies
        marker = Path(path) / _layout.MARKER
        if marker.exists():
            marker.unlink()
            raise KeyboardInterrupt

    monkeypatch.setattr(_layout.shutil, "rmtree", killed_midway)
    with pytest.raises(KeyboardInterrupt):
        rotate(tmp_path, keep_last=1)
    visible = [p for p in tmp_path.iterdir() if not p.name.startswith(".")]
    assert [p.name for p in visible] == ["step_00000002"]
    assert all((p / _layout.MARKER).is_file() for p in visible)
    leftovers = _layout.list_incomplete(tmp_path)
    assert [p.name for p in leftovers] == [".step_00000001.removing"]
    monkeypatch.undo()
    for p in leftovers:
        _layout.remove(p)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000002"]
