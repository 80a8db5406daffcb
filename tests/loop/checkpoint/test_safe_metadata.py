"""The contract between plait's restricted ``.metadata`` unpickler and the checkpoints torch writes.

DCP checkpoints of the installed torch (plain tensors of several dtypes and memory formats, bytes and
objects, nested dicts, an optimizer's state, plait's own training state, a 2-rank FSDP2 sharding) are
read with :class:`~plait.loop.checkpoint.safe_metadata.SafeFileSystemReader`: each must read, and
equal what torch's own ``FileSystemReader`` reads. A torch upgrade that pickles a class the allow-list
lacks fails here, naming it; one that renames an allowed class fails the existence check.
"""

from __future__ import annotations

import importlib
import io
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from plait.dist_core.testing import run_distributed
from plait.loop.checkpoint import (
    Checkpointer,
    ModelState,
    OptimizerState,
    RngState,
    UnsafeCheckpointError,
    ValueState,
)
from plait.loop.checkpoint.safe_metadata import ALLOWED, SafeFileSystemReader, load_metadata
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


def _model_and_optimizer() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6), nn.Linear(6, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()  # the optimizer's moments and step counters exist
    return model, opt


def _assert_reads_like_torch(path: Path) -> None:
    ours, torchs = SafeFileSystemReader(str(path)), FileSystemReader(str(path))
    ours.load_id = torchs.load_id  # each reader stamps its own load id into the metadata
    assert ours.read_metadata() == torchs.read_metadata()


def test_dcp_metadata_of_plain_tensors_bytes_objects_and_optimizer_state_reads_like_torch(tmp_path):
    model, opt = _model_and_optimizer()
    state = {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "blob": b"\x00raw bytes",
        "obj": {"name": "run", "ids": [1, 2], "pair": (3, 4.5), "none": None, "nested": {"deep": {"x": 1}}},
        "count": 7,
        "bf16": torch.arange(4, dtype=torch.bfloat16),
        "f16": torch.zeros(2, 3, dtype=torch.float16),
        "f64": torch.ones(2, dtype=torch.float64),
        "i8": torch.ones(2, dtype=torch.int8),
        "u8": torch.ones(2, dtype=torch.uint8),
        "i64": torch.arange(5),
        "bool": torch.ones(3, dtype=torch.bool),
        "c64": torch.ones(2, dtype=torch.complex64),
        "scalar": torch.tensor(1.5),
        "empty": torch.zeros(0),
        "channels_last": torch.zeros(1, 2, 3, 3).to(memory_format=torch.channels_last),
        "strided": torch.arange(12.0).view(3, 4).t(),
    }
    dcp.save(state, checkpoint_id=str(tmp_path))
    _assert_reads_like_torch(tmp_path)


def test_dcp_metadata_of_plaits_training_state_reads_like_torch(tmp_path):
    model, opt = _model_and_optimizer()
    ck = Checkpointer(tmp_path, async_mode="off")
    ck.save(
        1,
        {
            "model": ModelState(model),
            "optim": OptimizerState(model, opt),
            "rng": RngState(),
            "step": ValueState(1),
        },
    )
    _assert_reads_like_torch(tmp_path / "step_00000001")


def _save_fsdp2(root: str) -> None:
    model, _ = _model_and_optimizer()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp_shard",))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    state = {"model": ModelState(model), "optim": OptimizerState(model, opt), "rng": RngState()}
    Checkpointer(root, async_mode="off", process_group=dist.new_group(backend="gloo")).save(1, state)


def test_dcp_metadata_of_a_two_rank_fsdp2_checkpoint_reads_like_torch(tmp_path):
    run_distributed(_save_fsdp2, 2, str(tmp_path), timeout=300)
    path = tmp_path / "step_00000001"
    chunks = SafeFileSystemReader(str(path)).read_metadata().state_dict_metadata["model.0.weight"].chunks  # type: ignore[union-attr]
    assert len(chunks) == 2  # sharded: one chunk per rank
    _assert_reads_like_torch(path)


@pytest.mark.parametrize(("module", "name"), sorted(ALLOWED))
def test_each_allowed_global_still_exists(module, name):
    if module == "pathlib._local" and sys.version_info < (3, 13):
        pytest.skip("Python 3.13 pickles paths as pathlib._local's; earlier ones have no such module")
    assert getattr(importlib.import_module(module), name, None) is not None, (
        f"{module}.{name} no longer exists: update plait.loop.checkpoint.safe_metadata.ALLOWED"
    )


@pytest.mark.parametrize(
    "refused", ["builtins eval", "posix system", "torch load", "torch.serialization load", "torch _C"]
)
def test_any_other_global_is_refused_by_name(refused):
    module, name = refused.split()
    pickled = f"c{module}\n{name}\n.".encode()  # protocol 0: push the global, stop
    with pytest.raises(
        UnsafeCheckpointError, match=rf"some/.metadata is refused: its pickle names {module}\.{name}"
    ):
        load_metadata(io.BytesIO(pickled), "some/.metadata")
    assert load_metadata(io.BytesIO(b"ctorch\nbfloat16\n."), "x") is torch.bfloat16  # type: ignore[comparison-overlap]
