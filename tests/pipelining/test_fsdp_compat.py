"""The contract of FSDP2's private state that ``plait.pipelining.fsdp_compat`` relies on.

A torch upgrade that renames or drops any of it fails here, naming the attribute, before the
``gather_once`` tests fail for a reason that is harder to read.
"""

from __future__ import annotations

from typing import Any

import torch
from plait.dist_core.fsdp_state import param_groups
from plait.dist_core.testing import run_distributed
from plait.pipelining import fsdp_compat
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor


def _sharded() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (2,))
    inner = nn.Linear(8, 8)
    root = nn.Sequential(inner, nn.Linear(8, 4))
    fully_shard(inner, mesh=mesh, reshard_after_forward=True)
    fully_shard(root, mesh=mesh, reshard_after_forward=True)
    return root, inner


def _private_names(_: int) -> dict[str, Any]:
    root, inner = _sharded()
    assert isinstance(inner, FSDPModule)
    root(torch.randn(2, 8))  # lazy init
    state = inner._get_fsdp_state()
    groups = param_groups(inner)
    return {
        "_get_fsdp_state": hasattr(FSDPModule, "_get_fsdp_state"),
        "_fsdp_param_groups or _fsdp_param_group": hasattr(state, "_fsdp_param_groups")
        or hasattr(state, "_fsdp_param_group"),
        "state._is_root": isinstance(getattr(state, "_is_root", None), bool),
        "one parameter group": len(groups) == 1,
        "group.post_forward_mesh_info": all(hasattr(g, "post_forward_mesh_info") for g in groups),
    }


def _behaviour(_: int) -> dict[str, Any]:
    root, inner = _sharded()
    x = torch.randn(2, 8)
    root(x)
    resharded = isinstance(inner.weight, DTensor)  # configured: resharded after forward
    settings = fsdp_compat.post_forward_settings(inner)
    fsdp_compat.keep_unsharded_after_forward(inner)
    root(x)
    kept = not isinstance(inner.weight, DTensor) and tuple(inner.weight.shape) == (8, 8)
    inner.reshard()
    for s in settings:
        fsdp_compat.restore_post_forward(inner, s)
    root(x)
    return {
        "configured": settings[0][1] is not None,
        "resharded": resharded,
        "kept": kept,
        "restored": isinstance(inner.weight, DTensor),
    }


def test_fsdp2_private_names_exist() -> None:
    for rank, found in enumerate(run_distributed(_private_names, 2, 0)):
        missing = [name for name, ok in found.items() if not ok]
        assert not missing, f"rank {rank}: torch {torch.__version__} changed FSDP2 state: {missing}"


def test_keep_and_restore_change_what_fsdp2_does_after_forward() -> None:
    for rank, got in enumerate(run_distributed(_behaviour, 2, 0)):
        assert got == {"configured": True, "resharded": True, "kept": True, "restored": True}, (
            f"rank {rank}: {got}"
        )
