"""The contract between plait's checkpointing and torch.distributed.checkpoint's internals.

``plait.loop.checkpoint.dcp_compat`` is the only module that uses DCP's private names. These tests
state, name by name, what it relies on: that each exists, takes the parameters it is called with and
has the attributes it reads or assigns. A torch upgrade that changes one fails here, naming it.
The other checkpoint modules must not reach past ``dcp_compat`` (checked on their source).
"""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import plait.loop.checkpoint as checkpoint_pkg
import pytest
import torch
from plait.loop.checkpoint import dcp_compat


def _params(fn: object) -> list[str]:
    return list(inspect.signature(fn).parameters)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("module", "name", "needed"),
    [
        (
            "torch.distributed.checkpoint.state_dict_saver",
            "_save_state_dict",
            ["state_dict", "storage_writer", "process_group", "coordinator_rank", "no_dist", "planner"],
        ),
        ("torch.distributed.checkpoint.state_dict_saver", "_stateful_to_state_dict", ["state_dict"]),
        (
            "torch.distributed.checkpoint.state_dict_loader",
            "_load_state_dict",
            ["state_dict", "storage_reader", "process_group", "coordinator_rank", "no_dist", "planner"],
        ),
        ("torch.distributed.checkpoint._nested_dict", "flatten_state_dict", ["state_dict"]),
        ("torch.distributed.checkpoint._traverse", "set_element", ["root_dict", "path", "value"]),
        ("torch.distributed.checkpoint._async_process_executor", "_init_logger", ["rank"]),
        (
            "torch.distributed.checkpoint._async_process_executor",
            "_ProcessGroupInitInfo",
            ["process_group"],
        ),
        ("torch.distributed.checkpoint._async_process_executor", "_AsyncCheckpointProcess", ["pg_init_info"]),
        ("torch.cuda._pin_memory_utils", "pin_memory", []),
        ("torch.cuda._pin_memory_utils", "unpin_memory", []),
    ],
)
def test_the_private_functions_used_exist_with_the_parameters_passed(module, name, needed):
    fn = getattr(importlib.import_module(module), name, None)
    assert fn is not None, f"torch no longer has {module}.{name}: update plait.loop.checkpoint.dcp_compat"
    params = _params(fn)
    missing = [p for p in needed if p not in params]
    assert not missing, f"{module}.{name} no longer takes {missing} (has {params}): update dcp_compat"


def test_the_writer_process_internals_used_exist():
    from torch.distributed.checkpoint import _async_process_executor as ape

    assert hasattr(ape, "_CHECKPOINT_PROCESS"), "DCP's writer process is no longer ape._CHECKPOINT_PROCESS"
    entry = ape._AsyncCheckpointProcess.__dict__.get("_checkpointing_subprocess")
    assert isinstance(entry, staticmethod), (
        "_AsyncCheckpointProcess._checkpointing_subprocess is not a staticmethod"
    )
    # DCP's own entry, as dcp_compat kept it on import (a writer process started earlier in this
    # process routes the class attribute through plait's entry)
    own = dcp_compat.DCP_WRITER_ENTRY
    assert own.__module__ == ape.__name__, own
    assert _params(own)[:2] == ["pg_init_info", "parent_conn"], _params(own)
    # the entry looks the logger set-up up by name when it starts, so replacing it takes effect
    assert "_init_logger" in own.__code__.co_names
    assert callable(getattr(ape._AsyncCheckpointProcess, "__del__", None))
    # the writer joins the job's store under a prefix when this variable is set
    assert dcp_compat.PREFIX_STORE_ENV in inspect.getsource(ape)


def test_the_plan_caches_used_are_class_level_dicts_keyed_per_planner():
    from torch.distributed.checkpoint import DefaultSavePlanner
    from torch.distributed.checkpoint.planner import SavePlanner

    for name in dcp_compat.PLAN_CACHES:
        assert isinstance(getattr(SavePlanner, name, None), dict), f"SavePlanner.{name} is no longer a dict"
    planner = DefaultSavePlanner(enable_plan_caching=True)
    assert isinstance(getattr(planner, dcp_compat.PLAN_CACHE_KEY_ATTR, None), str), (
        f"DefaultSavePlanner has no {dcp_compat.PLAN_CACHE_KEY_ATTR}"
    )
    dcp_compat.set_plan_cache_key(planner, "contract/0")
    dcp_compat.plan_cache(dcp_compat.PLAN_CACHES[0])["contract/0"] = "x"
    dcp_compat.drop_plan_caches(planner)
    assert "contract/0" not in dcp_compat.plan_cache(dcp_compat.PLAN_CACHES[0])


def test_the_state_dict_stager_attributes_used_exist():
    from torch.distributed.checkpoint._state_dict_stager import StateDictStager
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    stager = StateDictStager(pin_memory=False, share_memory=True)
    for attr in ("_cached_storage_mapping", "share_memory", "pin_memory", "pin_memory_min_bytes"):
        assert hasattr(stager, attr), f"StateDictStager has no {attr}"
    assert callable(stager.close)
    default = DefaultStager(StagingOptions(False, False, False, False))
    assert hasattr(default, "_state_dict_stager"), "DefaultStager has no _state_dict_stager"
    default.close()
    storage = torch.zeros(3).untyped_storage()
    assert callable(getattr(type(storage), "_new_shared", None))


def test_the_reusing_stager_keeps_its_buffers_across_stages():
    """Independent check: a second stage of the same tensor copies into the buffer of the first."""
    from torch.distributed.checkpoint.staging import StagingOptions

    stager = dcp_compat.ReusingStager(StagingOptions(False, False, False, False))
    w = torch.arange(6.0)
    first = stager.stage({"w": w})["w"]
    w.add_(1)
    second = stager.stage({"w": w})["w"]
    assert second.data_ptr() == first.data_ptr() and torch.equal(second, torch.arange(6.0) + 1)
    stager.close()


def test_the_plan_record_types_are_the_private_types_of_a_saved_plan():
    from torch.distributed.checkpoint import filesystem, metadata

    names = {t.__name__ for t in dcp_compat.plan_record_types()}
    assert names == {"_StoragePrefix", "_MEM_FORMAT_ENCODING"}
    assert filesystem._StoragePrefix.__module__ == filesystem.__name__
    assert metadata._MEM_FORMAT_ENCODING.__module__ == metadata.__name__


def test_no_other_checkpoint_module_reaches_torch_internals():
    """Every private torch name plait's checkpointing uses goes through dcp_compat."""
    offenders = []
    for file in sorted(Path(checkpoint_pkg.__file__).parent.glob("*.py")):
        if file.name == "dcp_compat.py":
            continue
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch"):
                parts = [*(node.module or "").split("."), *(a.name for a in node.names)]
            elif isinstance(node, ast.Import):
                parts = [p for a in node.names if a.name.startswith("torch") for p in a.name.split(".")]
            else:
                continue
            if any(p.startswith("_") for p in parts):
                offenders.append(f"{file.name}:{node.lineno}")
    assert not offenders, f"torch internals imported outside dcp_compat: {offenders}"


def test_the_writer_process_stops_when_its_last_user_releases_it(monkeypatch):
    from plait.loop.checkpoint import writer_process as wp

    stopped = []
    monkeypatch.setattr(wp.dcp_compat, "stop_writer_process", lambda: stopped.append(True))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29999")
    monkeypatch.delenv(dcp_compat.PREFIX_STORE_ENV, raising=False)
    writer = wp.WriterProcess()
    writer.acquire(world_size=2)
    writer.acquire(world_size=2)
    assert writer.users == 2 and dcp_compat.os.environ[dcp_compat.PREFIX_STORE_ENV] == "1"
    writer.release()
    assert not stopped
    writer.release()
    assert stopped == [True] and writer.users == 0
    with pytest.raises(RuntimeError, match="without a matching acquire"):
        writer.release()
