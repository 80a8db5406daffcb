"""Warnings plait cannot act on are filtered where they arise, and only those."""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from plait.dist_core import DeviceMeshParameters, DistributedContext
from plait.loop.engine import quiet_cpu_mesh_init
from torch.distributed.tensor import Shard, distribute_tensor

_CPU_RNG = "DTensor random operators may not have complete support on cpu device mesh"


@pytest.mark.parametrize("quiet", [False, True], ids=["torch-warns", "plait-filters"])
def test_cpu_mesh_rng_warning_is_filtered_inside_the_init_block_only(quiet: bool) -> None:
    ctx = DistributedContext.from_env(DeviceMeshParameters(), device="cpu")
    try:
        t = distribute_tensor(torch.empty(8), ctx.mesh_for("flat"), [Shard(0)])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with quiet_cpu_mesh_init() if quiet else contextlib.nullcontext():
                t.normal_()  # a random init on a CPU mesh, as materialising a sharded model does
                warnings.warn("another warning", UserWarning, stacklevel=1)
    finally:
        ctx.shutdown()
    messages = [str(w.message) for w in caught]
    assert "another warning" in messages  # other warnings pass
    assert (_CPU_RNG in messages) is not quiet, messages
