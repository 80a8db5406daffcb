"""Reader, writer and module IO on one process, checked against safetensors and load_state_dict."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from plait.model_state import (
    INDEX_NAME,
    CheckpointFormatError,
    CheckpointReader,
    CheckpointWriter,
    KeyMismatchError,
    Rename,
    SpecMismatchError,
    Stack,
    TensorSpec,
    Transpose,
    is_meta,
    load_module,
    materialize,
    read_state,
    save_module,
)
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn


class Net(nn.Module):
    def __init__(self, tie: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.head = nn.Linear(8, 11, bias=False)
        self.register_buffer("steps", torch.arange(4))
        if tie:
            self.head.weight = self.embed.weight


def _hf_state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    s = {
        "model.embed.weight": torch.randn(11, 8, generator=g),
        "lm_head.weight": torch.randn(11, 8, generator=g),
    }
    for i in range(3):
        s[f"model.layers.{i}.w"] = torch.randn(8, 8, generator=g)
        s[f"model.layers.{i}.b"] = torch.randn(8, generator=g)
    s["model.steps"] = torch.arange(4) * 3
    return s


HF_TO_NET = Rename(
    {
        "model.embed.weight": "embed.weight",
        "lm_head.weight": "head.weight",
        "model.layers.{i}.w": "blocks.{i}.weight",
        "model.layers.{i}.b": "blocks.{i}.bias",
        "model.steps": "steps",
    }
)


def _write_hf_sharded(path: Path, state: dict[str, torch.Tensor], n_files: int = 3) -> None:
    """A sharded checkpoint written with safetensors itself plus a hand-made HF index."""
    path.mkdir(parents=True)
    keys = sorted(state)
    weight_map = {}
    for i in range(n_files):
        name = f"model-{i + 1:05d}-of-{n_files:05d}.safetensors"
        part = {k: state[k] for k in keys[i::n_files]}
        save_file(part, str(path / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
    (path / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))


def _reference_net(state: dict[str, torch.Tensor]) -> Net:
    net = Net()
    net.load_state_dict(HF_TO_NET.map_state(state))
    return net


def test_reader_sharded_index_and_slices(tmp_path: Path) -> None:
    state = _hf_state()
    _write_hf_sharded(tmp_path / "ck", state)
    with CheckpointReader(tmp_path / "ck") as r:
        assert len(r.files) == 3
        assert r.specs["lm_head.weight"] == TensorSpec((11, 8), torch.float32)
        for k, v in state.items():
            assert torch.equal(r.read(k), v)
        before = r.bytes_read
        part = r.read("lm_head.weight", ((2, 5), (1, 4)))
        assert torch.equal(part, state["lm_head.weight"][2:5, 1:4])
        assert r.bytes_read - before == 3 * 8 * 4  # tiny runs: whole rows 2..4 are read, then cut
        assert r.file_of("lm_head.weight").name.startswith("model-")
    # Large contiguous runs are read exactly: only the box's bytes.
    big = torch.randn(4, 2, 20000)
    save_file({"big": big}, str(tmp_path / "big.safetensors"))
    with CheckpointReader(tmp_path / "big.safetensors") as r:
        box = ((1, 3), (0, 2), (100, 17000))
        assert torch.equal(r.read("big", box), big[1:3, :, 100:17000])
        assert r.bytes_read == 2 * 2 * 16900 * 4
        out = torch.empty(1, 2, 20000)
        assert r.read("big", ((3, 4), (0, 2), (0, 20000)), out=out) is out and torch.equal(out, big[3:])
        with pytest.raises(ValueError, match="does not fit"):
            r.read("big", ((0, 5), (0, 2), (0, 1)))
    # The index file and a single file work as paths too.
    with CheckpointReader(tmp_path / "ck" / INDEX_NAME) as r:
        assert set(r.specs) == set(state)


def test_writer_sharded_output_is_valid_hf(tmp_path: Path) -> None:
    state = _hf_state()
    specs = {k: TensorSpec.of(v) for k, v in state.items()}
    with CheckpointWriter(
        tmp_path / "out", specs, max_shard_size=600, metadata={"step": "7"}, fsync=False
    ) as w:
        for k in reversed(list(state)):  # any order
            w.write(k, state[k])
    index = json.loads((tmp_path / "out" / INDEX_NAME).read_text())
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in state.values())
    assert index["metadata"]["step"] == "7"
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    loaded: dict[str, torch.Tensor] = {}
    for f in files:  # reference reader: safetensors itself
        part = load_file(str(tmp_path / "out" / f))
        assert all(index["weight_map"][k] == f for k in part)
        loaded.update(part)
        with safe_open(str(tmp_path / "out" / f), "pt") as h:
            assert h.metadata()["step"] == "7"
    assert sorted(loaded) == sorted(state)
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left


def test_writer_single_file_and_errors(tmp_path: Path) -> None:
    state = {
        "a": torch.randn(3, dtype=torch.bfloat16),
        "b": torch.tensor(True),
        "c": torch.arange(5, dtype=torch.int32),
    }
    specs = {k: TensorSpec.of(v) for k, v in state.items()}
    with CheckpointWriter(tmp_path / "one", specs, fsync=False) as w:
        for k, v in state.items():
            w.write(k, v)
    loaded = load_file(str(tmp_path / "one" / "model.safetensors"))
    assert all(torch.equal(loaded[k], v) for k, v in state.items())

    w = CheckpointWriter(tmp_path / "bad", specs, fsync=False)
    with pytest.raises(KeyMismatchError, match="'zzz'"):
        w.write("zzz", torch.zeros(1))
    with pytest.raises(SpecMismatchError, match="'a'"):
        w.write("a", torch.zeros(4, dtype=torch.bfloat16))
    w.write("a", state["a"])
    with pytest.raises(KeyMismatchError, match=r"never written.*'b'.*'c'"):
        w.commit()
    assert not (tmp_path / "bad").exists()


def test_load_into_meta_module_matches_load_state_dict(tmp_path: Path) -> None:
    state = _hf_state()
    _write_hf_sharded(tmp_path / "ck", state)
    with torch.device("meta"):
        net = Net()
    result = load_module(net, tmp_path / "ck", HF_TO_NET)
    ref = _reference_net(state)
    assert result.missing == () and result.unexpected == ()
    assert result.bytes_read == sum(v.numel() * v.element_size() for v in state.values())
    for k, v in ref.state_dict().items():
        assert torch.equal(net.state_dict()[k], v), k
    assert net.head.weight.device.type == "cpu"


def test_save_then_load_through_mapper(tmp_path: Path) -> None:
    ref = _reference_net(_hf_state(1))
    mapper = HF_TO_NET >> Transpose("blocks.{i}.weight")
    # Module -> HF-like checkpoint through the inverse, then back through the mapper.
    inverse = mapper.inverse()
    save_module(ref, tmp_path / "hf", inverse, max_shard_size=700, fsync=False)
    disk = read_state(tmp_path / "hf")
    assert torch.equal(disk["model.layers.1.w"], ref.blocks[1].weight.detach().T)
    net = Net()
    load_module(net, tmp_path / "hf", mapper)
    for k, v in ref.state_dict().items():
        assert torch.equal(net.state_dict()[k], v), k


def test_strict_and_non_strict_keys(tmp_path: Path) -> None:
    state = _hf_state()
    state.pop("model.layers.2.b")
    state["model.extra"] = torch.zeros(2)
    save_file(state, str(tmp_path / "x.safetensors"))
    with pytest.raises(KeyMismatchError) as e:
        load_module(Net(), tmp_path / "x.safetensors", HF_TO_NET)
    assert e.value.missing == ["blocks.2.bias"] and e.value.unexpected == ["model.extra"]
    assert "blocks.2.bias" in str(e.value) and "model.extra" in str(e.value)
    net = Net()
    before = net.blocks[2].bias.detach().clone()
    res = load_module(net, tmp_path / "x.safetensors", HF_TO_NET, strict=False)
    assert res.missing == ("blocks.2.bias",) and res.unexpected == ("model.extra",)
    assert torch.equal(net.blocks[2].bias, before)
    assert torch.equal(net.blocks[2].weight, state["model.layers.2.w"])


def test_shape_and_dtype_mismatch_before_reading(tmp_path: Path) -> None:
    state = _hf_state()
    state["model.layers.0.w"] = torch.zeros(8, 9)
    save_file(state, str(tmp_path / "s.safetensors"))
    with pytest.raises(SpecMismatchError, match=r"blocks\.0\.weight.*\[8, 9\]"):
        load_module(Net(), tmp_path / "s.safetensors", HF_TO_NET)
    state = _hf_state()
    state["lm_head.weight"] = state["lm_head.weight"].half()
    save_file(state, str(tmp_path / "d.safetensors"))
    with pytest.raises(SpecMismatchError, match=r"head\.weight.*float16"):
        load_module(Net(), tmp_path / "d.safetensors", HF_TO_NET)
    net = Net()
    load_module(net, tmp_path / "d.safetensors", HF_TO_NET, allow_cast=True)
    assert torch.equal(net.head.weight, state["lm_head.weight"].float())


def test_tied_weights_count_once(tmp_path: Path) -> None:
    state = _hf_state()
    state.pop("lm_head.weight")
    save_file(state, str(tmp_path / "t.safetensors"))
    net = Net(tie=True)
    load_module(net, tmp_path / "t.safetensors", HF_TO_NET)
    assert torch.equal(net.head.weight, state["model.embed.weight"])
    with torch.device("meta"):
        net = Net(tie=True)
    load_module(net, tmp_path / "t.safetensors", HF_TO_NET)  # to_empty unties; the loader re-ties
    assert net.head.weight is net.embed.weight
    assert torch.equal(net.head.weight, state["model.embed.weight"])


def test_materialize_allocates_meta_modules_and_reties() -> None:
    with torch.device("meta"):
        net = Net(tie=True)
    assert all(is_meta(p) for p in net.parameters())
    plain = nn.Module.to_empty(Net(tie=True).to("meta"), device="cpu")  # what to_empty alone does
    assert plain.head.weight is not plain.embed.weight
    assert materialize(net)
    assert not any(is_meta(t) for t in net.state_dict().values())
    assert net.head.weight is net.embed.weight and net.head.weight.device.type == "cpu"
    params = [id(p) for p in net.parameters()]
    assert not materialize(net, "meta")  # nothing on meta: left as it is
    assert [id(p) for p in net.parameters()] == params and not is_meta(net.head.weight)


def test_stacked_experts_load_reads_each_byte_once(tmp_path: Path) -> None:
    experts = {f"e.{i}": torch.randn(4, 3) for i in range(5)}
    save_file(experts, str(tmp_path / "e.safetensors"))

    class Grouped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.empty(5, 4, 3))

    m = Grouped()
    load_module(m, tmp_path / "e.safetensors", Stack("e.{i}", "w", over="i"))
    assert torch.equal(m.w, torch.stack([experts[f"e.{i}"] for i in range(5)]))


def _corrupt(path: Path, fn) -> Path:
    data = bytearray(path.read_bytes())
    path.write_bytes(fn(data))
    return path


def test_corrupted_header_and_truncated_file(tmp_path: Path) -> None:
    good = tmp_path / "g.safetensors"
    save_file({"a": torch.randn(64, 64), "b": torch.randn(10)}, str(good))
    raw = good.read_bytes()

    bad_header = tmp_path / "h.safetensors"
    bad_header.write_bytes(raw[:8] + b"{" * 20 + raw[28:])
    with pytest.raises(CheckpointFormatError, match=r"h\.safetensors: corrupted safetensors header"):
        CheckpointReader(bad_header)

    huge = tmp_path / "len.safetensors"
    huge.write_bytes((10**12).to_bytes(8, "little") + raw[8:])
    with pytest.raises(
        CheckpointFormatError, match=r"len\.safetensors: corrupted safetensors header: header length"
    ):
        CheckpointReader(huge)

    truncated = tmp_path / "t.safetensors"
    truncated.write_bytes(raw[: len(raw) - 1000])
    with pytest.raises(CheckpointFormatError, match=r"t\.safetensors: truncated safetensors file"):
        CheckpointReader(truncated)

    (tmp_path / "idx").mkdir()
    (tmp_path / "idx" / INDEX_NAME).write_text('{"weight_map": {"a": "nope.safetensors"}}')
    with pytest.raises(CheckpointFormatError, match=r"nope\.safetensors"):
        CheckpointReader(tmp_path / "idx")
    (tmp_path / "idx" / INDEX_NAME).write_text("{not json")
    with pytest.raises(CheckpointFormatError, match=INDEX_NAME):
        CheckpointReader(tmp_path / "idx")
    with pytest.raises(FileNotFoundError):
        CheckpointReader(tmp_path / "absent")


def test_overwrite_replaces_previous_checkpoint(tmp_path: Path) -> None:
    a, b = {"x": torch.zeros(3)}, {"y": torch.ones(2)}
    for state in (a, b):
        with CheckpointWriter(
            tmp_path / "ck", {k: TensorSpec.of(v) for k, v in state.items()}, fsync=False
        ) as w:
            for k, v in state.items():
                w.write(k, v)
    assert sorted(load_file(str(tmp_path / "ck" / "model.safetensors"))) == ["y"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
