"""Peak host memory while streaming, and crash safety of the writer, in subprocesses."""

from __future__ import annotations

import json
import os
import runpy
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from plait.model_state import read_state
from plait.model_state.cli import main
from safetensors.torch import load_file, save_file

N_LAYERS, N_EXPERTS, ROWS, COLS = 32, 8, 256, 512  # 32 x 8 x 512 KiB = 128 MiB of experts
EXPERT_BYTES = ROWS * COLS * 4
GROUP_BYTES = N_EXPERTS * EXPERT_BYTES  # the largest group: one stacked layer (4 MiB)

_MEMORY_SCRIPT = textwrap.dedent(
    """
    import json, sys, torch
    from torch import nn
    from plait.model_state import Stack, load_module, save_module

    def status(key):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024

    def reset_peak():
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")

    torch.set_num_threads(1)
    src, out, n_layers, n_experts, rows, cols = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:7])
    model = nn.Module()
    for i in range(n_layers):
        model.register_parameter(f"w{i}", nn.Parameter(torch.zeros(n_experts, rows, cols)))
    mapper = Stack("layers.{i}.experts.{e}", "w{i}", over="e")
    reset_peak(); base = status("VmRSS")
    load_module(model, src, mapper)
    load_peak = status("VmHWM") - base
    reset_peak(); base = status("VmRSS")
    save_module(model, out, mapper.inverse(), max_shard_size=20 * 2**20, fsync=False)
    save_peak = status("VmHWM") - base
    print(json.dumps({"load": load_peak, "save": save_peak, "check": float(model.w3[5, 7, 11])}))
    """
)


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc peak-RSS reset")
def test_streaming_peak_memory_is_about_one_group(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    src = tmp_path / "src.safetensors"
    state = {
        f"layers.{i}.experts.{e}": torch.randn(ROWS, COLS, generator=g)
        for i in range(N_LAYERS)
        for e in range(N_EXPERTS)
    }
    save_file(state, str(src))
    total = len(state) * EXPERT_BYTES
    args = [str(src), str(tmp_path / "out"), str(N_LAYERS), str(N_EXPERTS), str(ROWS), str(COLS)]
    # glibc's malloc raises its mmap threshold to the largest block freed so far, after which freed
    # group buffers stay in the heap (resident) for later reuse: the peak then varied by ~10 MiB from run
    # to run with the threads' timing. A fixed threshold (its default start value) returns each freed
    # buffer, so the peak is what the loader holds.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    proc = subprocess.run(
        [sys.executable, "-c", _MEMORY_SCRIPT, *args], capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["check"] == float(state["layers.3.experts.5"][7, 11])
    bound = 2 * GROUP_BYTES + 4 * 2**20  # 12 MiB: the constant covers allocator/dispatcher warm-up
    assert got["load"] <= bound, (
        f"load peak {got['load'] / 2**20:.1f} MiB > {bound / 2**20:.1f} MiB (total {total / 2**20:.0f} MiB)"
    )
    assert got["save"] <= bound, (
        f"save peak {got['save'] / 2**20:.1f} MiB > {bound / 2**20:.1f} MiB (total {total / 2**20:.0f} MiB)"
    )
    saved: dict[str, torch.Tensor] = {}
    for f in sorted((tmp_path / "out").glob("*.safetensors")):
        saved.update(load_file(str(f)))
    assert sorted(saved) == sorted(state)
    assert all(torch.equal(saved[k], state[k]) for k in state)


_CRASH_SCRIPT = textwrap.dedent(
    """
    import sys, time, torch
    from plait.model_state import CheckpointWriter, TensorSpec
    out = sys.argv[1]
    specs = {f"t{i}": TensorSpec((1024,), torch.float32) for i in range(8)}
    w = CheckpointWriter(out, specs, max_shard_size=8192, fsync=False)
    for i in range(8):
        w.write(f"t{i}", torch.full((1024,), 2.0))
        if i == 4:
            print("HALF", flush=True)
            time.sleep(60)
    w.commit()
    """
)


def test_writer_killed_mid_write_keeps_previous_checkpoint(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    ck.mkdir()
    old = {f"t{i}": torch.full((1024,), 1.0) for i in range(8)}
    save_file(old, str(ck / "model.safetensors"))
    before = sorted(p.name for p in ck.iterdir())
    proc = subprocess.Popen([sys.executable, "-c", _CRASH_SCRIPT, str(ck)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 120
        line = ""
        while "HALF" not in line and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                break
        assert "HALF" in line, "writer did not reach the middle of the write"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    # The previous checkpoint is untouched; the new one is only hidden temporary files beside it.
    after = sorted(p.name for p in ck.iterdir())
    hidden = [n for n in after if n not in before]
    assert [n for n in after if n in before] == before
    assert hidden and all(n.startswith(".plait-tmp-") and n.endswith(".tmp") for n in hidden)
    loaded = load_file(str(ck / "model.safetensors"))
    assert all(torch.equal(loaded[k], v) for k, v in old.items())
    got = read_state(ck)  # the reader ignores the temporaries
    assert sorted(got) == sorted(old) and all(torch.equal(got[k], v) for k, v in old.items())
    assert [p for p in tmp_path.iterdir()] == [ck]  # nothing written outside the checkpoint directory


def test_cli_inspect_and_diff(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    a = {"x": torch.arange(6.0).reshape(2, 3), "y": torch.zeros(2, dtype=torch.int64)}
    save_file(a, str(tmp_path / "a.safetensors"))
    b = {"x": a["x"] + 0.5, "z": torch.ones(1)}
    save_file(b, str(tmp_path / "b.safetensors"))
    # Through the real `python -m plait.model_state` entry point, in-process.
    monkeypatch.setattr(sys, "argv", ["plait.model_state", "inspect", str(tmp_path / "a.safetensors")])
    with pytest.raises(SystemExit) as e:
        runpy.run_module("plait.model_state", run_name="__main__")
    out = capsys.readouterr().out
    assert e.value.code == 0
    assert "[2, 3]" in out and "2 tensors" in out and "float32" in out and "a.safetensors" in out

    assert main(["diff", str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors")]) == 1
    out = capsys.readouterr().out
    assert "only in A: y" in out and "only in B: z" in out and "max abs diff 0.5" in out
    assert (
        main(["diff", str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors"), "--atol", "1"]) == 1
    )  # keys differ
    assert main(["diff", str(tmp_path / "a.safetensors"), str(tmp_path / "a.safetensors")]) == 0
    assert "SAME" in capsys.readouterr().out
    c = {"x": a["x"].double(), "y": a["y"]}
    save_file(c, str(tmp_path / "c.safetensors"))
    assert main(["diff", str(tmp_path / "a.safetensors"), str(tmp_path / "c.safetensors")]) == 1
    assert "spec differs: x" in capsys.readouterr().out


_PUBLISH_CRASH_SCRIPT = textwrap.dedent(
    """
    import os, sys, time, torch
    from plait.model_state import CheckpointWriter, TensorSpec
    out = sys.argv[1]
    replace = os.replace
    def slow_replace(src, dst):  # stop for the kill after the first shard is published
        replace(src, dst)
        if str(dst).endswith("model-00001-of-00004.safetensors"):
            print("RENAMED", flush=True)
            time.sleep(60)
    os.replace = slow_replace
    specs = {f"t{i}": TensorSpec((1024,), torch.float32) for i in range(8)}
    with CheckpointWriter(out, specs, max_shard_size=8192, fsync=False) as w:
        for i in range(8):
            w.write(f"t{i}", torch.full((1024,), 2.0))
    """
)


def test_sharded_export_killed_while_publishing_is_never_a_mix(tmp_path: Path) -> None:
    from plait.model_state import CheckpointWriter, TensorSpec

    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "tokenizer.json").write_text("{}")
    old = {f"t{i}": torch.full((1024,), 1.0) for i in range(8)}
    specs = {k: TensorSpec.of(v) for k, v in old.items()}
    with CheckpointWriter(ck, specs, max_shard_size=8192, fsync=False) as w:  # 4 shards of 2 tensors
        for k, v in old.items():
            w.write(k, v)
    proc = subprocess.Popen(
        [sys.executable, "-c", _PUBLISH_CRASH_SCRIPT, str(ck)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and "RENAMED" in proc.stdout.readline()
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    got = read_state(ck)  # the old checkpoint, whole: not the new first shard with the old rest
    assert sorted(got) == sorted(old) and all(torch.equal(got[k], v) for k, v in old.items())
    assert any(p.name.startswith(".plait-tmp-") for p in [*ck.iterdir(), *tmp_path.iterdir()])
    # the next export removes what the killed one left, inside and beside the directory
    new = {k: torch.full((1024,), 3.0) for k in old}
    with CheckpointWriter(ck, specs, max_shard_size=8192, fsync=False) as w:
        for k, v in new.items():
            w.write(k, v)
    got = read_state(ck)
    assert all(torch.equal(got[k], v) for k, v in new.items())
    assert not [p for p in [*ck.iterdir(), *tmp_path.iterdir()] if p.name.startswith(".plait-tmp-")]
    assert (ck / "tokenizer.json").read_text() == "{}"
