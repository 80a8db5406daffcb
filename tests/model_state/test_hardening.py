"""Writers keep files they do not own, hostile checkpoints are refused, no numpy, CLI errors."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from plait.model_state import (
    INDEX_NAME,
    CheckpointFormatError,
    CheckpointReader,
    CheckpointWriter,
    TensorSpec,
    read_state,
    save_module,
)
from plait.model_state.cli import main
from safetensors.torch import load_file, save_file
from torch import nn

# --- a writer replaces only its own files ------------------------------------------------


def _state(seed: int, n: int = 6) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(4, 8, generator=g) for i in range(n)}


def _write(out: Path, state: dict[str, torch.Tensor], max_shard_size: int) -> None:
    with CheckpointWriter(
        out, {k: TensorSpec.of(v) for k, v in state.items()}, max_shard_size=max_shard_size, fsync=False
    ) as w:
        for k, v in state.items():
            w.write(k, v)


def _foreign(out: Path) -> dict[Path, bytes]:
    """Files a user keeps next to the weights; the writer must not touch them."""
    files = {
        out / "tokenizer.json": b'{"version": "1.0"}',
        out / "README.md": b"# my model\n",
        out / "config.json": b'{"model_type": "qwen3"}',
        out / "extra" / "notes.txt": b"keep me",
        # Named like a shard, but no index lists it: not the writer's to remove.
        out / "model-00007-of-00009.safetensors": b"not listed by any index",
    }
    for p, data in files.items():
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    return files


def _assert_loads(out: Path, state: dict[str, torch.Tensor]) -> None:
    got = read_state(out)
    assert sorted(got) == sorted(state)
    assert all(torch.equal(got[k], v) for k, v in state.items())
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]  # no temporary left


def test_writer_keeps_other_files_and_replaces_only_its_own(tmp_path: Path) -> None:
    out = tmp_path / "ck"
    out.mkdir()
    foreign = _foreign(out)
    one_tensor = 4 * 8 * 4

    _write(out, (s1 := _state(1)), max_shard_size=3 * one_tensor)  # 2 shards + index
    assert sorted(json.loads((out / INDEX_NAME).read_text())["weight_map"].values())[-1] == (
        "model-00002-of-00002.safetensors"
    )
    _assert_loads(out, s1)

    _write(out, (s2 := _state(2)), max_shard_size=2 * one_tensor)  # 3 shards: the names all change
    names = {p.name for p in out.iterdir()}
    assert {f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)} <= names
    assert not names & {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}
    _assert_loads(out, s2)

    _write(out, (s3 := _state(3, n=2)), max_shard_size=2**20)  # one file: the index and shards go
    assert not (out / INDEX_NAME).exists()
    assert not [
        n for n in os.listdir(out) if n.startswith("model-0000") and n.endswith("-of-00003.safetensors")
    ]
    assert set(load_file(str(out / "model.safetensors"))) == set(s3)
    _assert_loads(out, s3)

    _write(out, (s4 := _state(4)), max_shard_size=3 * one_tensor)  # sharded again: model.safetensors goes
    assert not (out / "model.safetensors").exists()
    _assert_loads(out, s4)

    for p, data in foreign.items():
        assert p.read_bytes() == data, f"{p} was changed or removed"


def test_save_module_and_abort_keep_other_files(tmp_path: Path) -> None:
    out = tmp_path / "hf"
    out.mkdir()
    foreign = _foreign(out)
    net = nn.Linear(3, 2)
    save_module(net, out, fsync=False)
    saved = load_file(str(out / "model.safetensors"))
    assert all(torch.equal(saved[k], v) for k, v in net.state_dict().items())

    w = CheckpointWriter(out, {"a": TensorSpec((2,), torch.float32)}, fsync=False)
    w.abort()
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [
            "README.md",
            "config.json",
            "extra",
            "model-00007-of-00009.safetensors",
            "model.safetensors",
            "tokenizer.json",
        ]
    )
    for p, data in foreign.items():
        assert p.read_bytes() == data


# --- hostile indexes and headers ----------------------------------------------------------


def _index(ck: Path, weight_map: dict[str, str]) -> None:
    (ck / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlink"])
def test_index_naming_a_file_outside_the_checkpoint_is_refused(tmp_path: Path, how: str) -> None:
    ck = tmp_path / "models" / "ck"
    ck.mkdir(parents=True)
    save_file({"a": torch.ones(2)}, str(ck / "model-00001-of-00002.safetensors"))
    outside = tmp_path / "secret.safetensors"  # a valid file: only its place makes it wrong
    save_file({"b": torch.ones(2)}, str(outside))
    if how == "dotdot":
        name = "../../secret.safetensors"
    elif how == "absolute":
        name = str(outside)
    else:
        name = "model-00002-of-00002.safetensors"
        (ck / name).symlink_to(outside)
    _index(ck, {"a": "model-00001-of-00002.safetensors", "b": name})
    with pytest.raises(CheckpointFormatError, match="outside the checkpoint directory") as e:
        CheckpointReader(ck)
    assert str(ck / INDEX_NAME) in str(e.value) and "'b'" in str(e.value) and name in str(e.value)


def test_hugging_face_cache_snapshot_links_into_blobs_are_read(tmp_path: Path) -> None:
    repo = tmp_path / "models--org--name"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / "0123abcd"
    snap.mkdir(parents=True)
    state = {"a": torch.arange(3.0), "b": torch.ones(2, 2)}
    for i, k in enumerate(state):
        save_file({k: state[k]}, str(repo / "blobs" / f"hash{i}"))
        (snap / f"model-0000{i + 1}-of-00002.safetensors").symlink_to(f"../../blobs/hash{i}")
    _index(snap, {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"})
    got = read_state(snap)
    assert all(torch.equal(got[k], v) for k, v in state.items())


def _raw_safetensors(path: Path, header: dict[str, object], data: bytes) -> None:
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def test_negative_dimensions_are_refused(tmp_path: Path) -> None:
    f = tmp_path / "neg.safetensors"
    # (-2) * (-3) * 4 bytes = 24: the length check alone passes.
    _raw_safetensors(f, {"w": {"dtype": "F32", "shape": [-2, -3], "data_offsets": [0, 24]}}, bytes(24))
    with pytest.raises(CheckpointFormatError, match=r"neg\.safetensors.*'w'.*non-negative"):
        CheckpointReader(f)


def test_overlapping_data_offsets_are_refused(tmp_path: Path) -> None:
    f = tmp_path / "overlap.safetensors"
    header = {
        "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
        "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]},
        "empty": {"dtype": "F32", "shape": [0], "data_offsets": [8, 8]},  # zero bytes overlap nothing
    }
    _raw_safetensors(f, header, bytes(24))
    with pytest.raises(CheckpointFormatError, match=r"overlap\.safetensors.*'b'.*overlap.*'a'"):
        CheckpointReader(f)


# --- torch + safetensors only (no numpy) --------------------------------------------------

_NO_NUMPY = textwrap.dedent(
    """
    import sys
    sys.modules["numpy"] = None  # any `import numpy` raises ImportError
    import json, torch
    from torch import nn
    from plait.model_state import CheckpointReader, Rename, load_module, save_module
    assert "numpy" not in sys.modules or sys.modules["numpy"] is None
    src, out = sys.argv[1], sys.argv[2]
    net = nn.Linear(64, 32)
    load_module(net, src, Rename({"layer.weight": "weight", "layer.bias": "bias"}))
    save_module(net, out, fsync=False)
    with CheckpointReader(src) as r:
        box = r.read("layer.weight", ((8, 16), (0, 4)))  # a small box: read rows, cut in memory
    print(json.dumps({"weight": net.weight.tolist(), "bias": net.bias.tolist(), "box": box.tolist()}))
    """
)


def test_load_and_save_work_without_numpy(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    state = {"layer.weight": torch.randn(32, 64, generator=g), "layer.bias": torch.randn(32, generator=g)}
    save_file(state, str(tmp_path / "src.safetensors"))
    proc = subprocess.run(
        [sys.executable, "-c", _NO_NUMPY, str(tmp_path / "src.safetensors"), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert torch.equal(torch.tensor(got["weight"]), state["layer.weight"])
    assert torch.equal(torch.tensor(got["bias"]), state["layer.bias"])
    assert torch.equal(torch.tensor(got["box"]), state["layer.weight"][8:16, :4])
    saved = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert torch.equal(saved["weight"], state["layer.weight"]) and torch.equal(
        saved["bias"], state["layer.bias"]
    )


# --- the CLI's errors and its diff summary ----------------------------------------------


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "plait.model_state", *args], capture_output=True, text=True, timeout=300
    )


def test_cli_errors_are_one_line_naming_the_file(tmp_path: Path) -> None:
    missing = tmp_path / "nothing-here"
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\xff" * 64)
    good = tmp_path / "good.safetensors"
    save_file({"x": torch.ones(2)}, str(good))
    for args, culprit in [
        (["inspect", str(missing)], missing),
        (["inspect", str(bad)], bad),
        (["diff", str(good), str(bad)], bad),
    ]:
        proc = _cli(*args)
        assert proc.returncode == 2, (args, proc.stdout, proc.stderr)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert lines[0].startswith("python -m plait.model_state: error:") and str(culprit) in lines[0]


def test_cli_diff_says_when_no_tensors_were_comparable(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    save_file({"x": torch.zeros(2, 3)}, str(a))
    save_file({"x": torch.zeros(3, 2)}, str(b))  # same key, other shape: nothing to compare
    assert main(["diff", str(a), str(b)]) == 1
    out = capsys.readouterr().out
    assert "no tensors were comparable" in out and "max abs diff" not in out
    c = tmp_path / "c.safetensors"
    save_file({"y": torch.zeros(2, 3)}, str(c))  # no common key
    assert main(["diff", str(a), str(c)]) == 1
    out = capsys.readouterr().out
    assert "no tensors were comparable" in out and "max abs diff" not in out
    assert main(["diff", str(a), str(a)]) == 0
    assert "max abs diff 0 over 1 compared" in capsys.readouterr().out


def test_cli_diff_counts_nonfinite_values_equal_to_themselves(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b, c = tmp_path / "a.safetensors", tmp_path / "b.safetensors", tmp_path / "c.safetensors"
    nonfinite = torch.tensor([1.0, float("inf"), float("-inf"), float("nan")])
    save_file({"x": nonfinite, "y": torch.ones(2)}, str(a))
    save_file({"x": nonfinite.clone(), "y": torch.ones(2)}, str(b))
    assert main(["diff", str(a), str(a)]) == 0
    assert main(["diff", str(a), str(b)]) == 0
    assert capsys.readouterr().out.endswith("max abs diff 0 over 2 compared\nSAME\n")
    for other in ([1.0, float("inf"), float("inf"), float("nan")], [1.0, float("inf"), float("-inf"), 0.0]):
        save_file({"x": torch.tensor(other), "y": torch.ones(2)}, str(c))
        assert main(["diff", str(a), str(c)]) == 1
        out = capsys.readouterr().out
        assert "values differ: x: max abs diff inf" in out and out.endswith("DIFFERENT\n")


def test_swap_without_rename_exchange_and_its_interrupted_state_repaired(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from plait.model_state import writer

    out = tmp_path / "ck"
    out.mkdir()
    foreign = _foreign(out)
    one_tensor = 4 * 8 * 4
    _write(out, _state(1), max_shard_size=3 * one_tensor)
    monkeypatch.setattr(writer, "_exchange", lambda a, b: False)  # a file system without it: two renames
    _write(out, (s2 := _state(2)), max_shard_size=2 * one_tensor)
    _assert_loads(out, s2)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".plait-tmp-")]
    # killed between the two renames: the checkpoint only under its .old name; the next writer puts it back
    os.replace(out, tmp_path / ".plait-tmp-0123456789ab-ck.old")
    (tmp_path / ".plait-tmp-0123456789ab-ck.new").mkdir()
    assert writer.clean_interrupted(out)
    _assert_loads(out, s2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    for p, data in foreign.items():
        assert p.read_bytes() == data
