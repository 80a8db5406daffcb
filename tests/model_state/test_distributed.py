"""Distributed load/save on gloo ranks against a full single-process load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from plait.dist_core.testing import run_distributed
from plait.model_state import (
    INDEX_NAME,
    Distribute,
    Rename,
    Stack,
    convert_checkpoint,
    load_module,
    read_state,
    save_module,
)
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(13, 6)  # 13 rows: uneven over 2 and 4 ranks
        self.layers = nn.ModuleList(nn.Linear(6, 6) for _ in range(2))
        self.experts = nn.Parameter(torch.empty(4, 5, 6))
        self.head = nn.Linear(6, 13, bias=False)


MAPPER = Rename(
    {
        "model.embed.weight": "embed.weight",
        "model.layers.{i}.{p}": "layers.{i}.{p}",
        "lm_head.weight": "head.weight",
    }
) >> Stack("model.experts.{e}.w", "experts", over="e")


def _checkpoint(path: Path) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    s = {
        "model.embed.weight": torch.randn(13, 6, generator=g),
        "lm_head.weight": torch.randn(13, 6, generator=g),
    }
    for i in range(2):
        s[f"model.layers.{i}.weight"] = torch.randn(6, 6, generator=g)
        s[f"model.layers.{i}.bias"] = torch.randn(6, generator=g)
    for e in range(4):
        s[f"model.experts.{e}.w"] = torch.randn(5, 6, generator=g)
    path.mkdir(parents=True, exist_ok=True)
    keys = sorted(s)
    wm = {}
    for i in range(2):
        name = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({k: s[k] for k in keys[i::2]}, str(path / name))
        wm.update(dict.fromkeys(keys[i::2], name))
    (path / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    return s


def _full_reference(path: str) -> dict[str, torch.Tensor]:
    m = Model()
    load_module(m, path, MAPPER)
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def _fsdp_load(path: str, meta: bool) -> tuple[dict[str, torch.Tensor], int, int]:
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    if meta:
        with torch.device("meta"):
            m = Model()
    else:
        m = Model()
    for layer in m.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh)
    res = load_module(m, path, MAPPER)
    full = {}
    local_bytes = 0
    for k, v in m.state_dict().items():
        assert isinstance(v, DTensor), k
        local_bytes += v.to_local().numel() * v.element_size()
        full[k] = v.full_tensor().clone()
    return full, res.bytes_read, local_bytes


# 4 ranks first: the harness pool then grows once and every later call reuses it.
@pytest.mark.parametrize(("world", "meta"), [(4, True), (2, False)])
def test_fsdp2_load_equals_full_load(tmp_path: Path, world: int, meta: bool) -> None:
    state = _checkpoint(tmp_path / "ck")
    ref = _full_reference(str(tmp_path / "ck"))
    results = run_distributed(_fsdp_load, world, str(tmp_path / "ck"), meta, timeout=120)
    total = sum(v.numel() * v.element_size() for v in state.values())
    for full, bytes_read, local_bytes in results:
        assert sorted(full) == sorted(ref)
        for k in ref:
            assert torch.equal(full[k], ref[k]), k
        assert bytes_read == local_bytes < total  # each rank read only its shard's bytes
    assert sum(r[1] for r in results) == total


def _distribute_load(path: str) -> tuple[dict[str, torch.Tensor], int]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    mapper = MAPPER >> Distribute(
        mesh, {"head.weight": [Replicate(), Shard(0)], "experts": [Shard(0), Shard(2)]}
    )
    out: dict[str, torch.Tensor] = {}
    from plait.model_state import CheckpointReader

    with CheckpointReader(path) as r:
        plan = mapper.plan(r.specs)
        for g in plan.groups:
            if not ({"head.weight", "experts"} & g.output_keys):
                continue
            in_regions, fn = g.sliced()
            for k, v in fn({k: r.read(k, in_regions[k]) for k in g.inputs}).items():
                assert isinstance(v, DTensor)
                out[k] = v.full_tensor()
        return out, r.bytes_read


def test_distribute_mapper_reads_only_local_bytes(tmp_path: Path) -> None:
    state = _checkpoint(tmp_path / "ck")
    ref = _full_reference(str(tmp_path / "ck"))
    for full, bytes_read in run_distributed(_distribute_load, 4, str(tmp_path / "ck")):
        assert torch.equal(full["head.weight"], ref["head.weight"])
        assert torch.equal(full["experts"], ref["experts"])
        head = state["lm_head.weight"]
        # head [13, 6]: rows split over tp (7 or 6 rows, read exactly). experts [4, 5, 6]: 2 experts per
        # dp rank; their column split over tp gives tiny runs, so those 2 experts are read whole.
        assert bytes_read in ((7 * 6 + 2 * 5 * 6) * 4, (6 * 6 + 2 * 5 * 6) * 4)
        assert bytes_read < (head.numel() + 4 * 30) * 4


def _pipeline_save(out: str) -> None:
    """Two pipeline stages x two data-parallel ranks: FSDP2 per stage, one writer per stage."""
    rank = dist.get_rank()
    stage, dp = divmod(rank, 2)
    torch.manual_seed(0)
    full = Model()  # the same seed on every rank: the reference model
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))["dp"]
    stage_module = nn.Module()
    if stage == 0:
        stage_module.embed = full.embed
        stage_module.layers = nn.ModuleList([full.layers[0]])
    else:
        stage_module.layers = nn.ModuleList([nn.Identity(), full.layers[1]])
        stage_module.head = full.head
        stage_module.experts = full.experts
        with torch.no_grad():
            full.experts.normal_()
    fully_shard(stage_module, mesh=mesh)
    save_module(stage_module, out, MAPPER.inverse(), max_shard_size=400, is_writer=(dp == 0), fsync=False)


def test_pipeline_stage_writing_gives_one_hf_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "tokenizer.json").write_text("{}")  # not the writers' file: it stays
    run_distributed(_pipeline_save, 4, str(tmp_path / "out"))
    torch.manual_seed(0)
    ref = Model()
    with torch.no_grad():
        ref.experts.normal_()
    index = json.loads((tmp_path / "out" / INDEX_NAME).read_text())
    loaded: dict[str, torch.Tensor] = {}
    for f in sorted(set(index["weight_map"].values())):
        loaded.update(load_file(str(tmp_path / "out" / f)))
    assert sorted(loaded) == sorted(index["weight_map"])
    expected = MAPPER.inverse().map_state(dict(ref.state_dict()))
    assert sorted(loaded) == sorted(expected)
    for k, v in expected.items():
        assert torch.equal(loaded[k], v), k
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in expected.values())
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(
        [*set(index["weight_map"].values()), INDEX_NAME, "tokenizer.json"]
    )  # every rank's temporaries were renamed, nothing else added or removed
    assert (tmp_path / "out" / "tokenizer.json").read_text() == "{}"


def _convert(src: str, dst: str) -> list[str]:
    convert_checkpoint(src, dst, MAPPER, max_shard_size=300, fsync=False)
    return sorted(Path(dst).iterdir())


def test_distributed_conversion(tmp_path: Path) -> None:
    _checkpoint(tmp_path / "ck")
    run_distributed(_convert, 2, str(tmp_path / "ck"), str(tmp_path / "conv"))
    ref = _full_reference(str(tmp_path / "ck"))
    got = read_state(tmp_path / "conv")
    assert sorted(got) == sorted(ref)
    assert all(torch.equal(got[k], ref[k]) for k in ref)


def _fsdp_tp_load(path: str) -> dict[str, torch.Tensor]:
    """2-D mesh: tensor parallel inside, FSDP2 across (strided shards: not a box, read whole)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    with torch.device("meta"):
        m = Model()
    parallelize_module(m.layers[0], mesh["tp"], ColwiseParallel())
    parallelize_module(m.layers[1], mesh["tp"], RowwiseParallel())
    fully_shard(m, mesh=mesh["dp"])
    load_module(m, path, MAPPER)
    return {
        k: v.full_tensor().clone() if isinstance(v, DTensor) else v.clone() for k, v in m.state_dict().items()
    }


def test_fsdp_over_tp_load_equals_full_load(tmp_path: Path) -> None:
    _checkpoint(tmp_path / "ck")
    ref = _full_reference(str(tmp_path / "ck"))
    for full in run_distributed(_fsdp_tp_load, 4, str(tmp_path / "ck")):
        assert sorted(full) == sorted(ref)
        for k in ref:
            assert torch.equal(full[k], ref[k]), k
