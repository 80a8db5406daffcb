"""Collective helpers with per-rank shapes and scalar reductions over mesh dimensions (4 CPU ranks)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from plait.dist_core import (
    DeviceMeshParameters,
    DistributedContext,
    all_gather_object,
    all_gather_uneven,
    gather_uneven,
    reduce_scalar,
)
from plait.dist_core.testing import DistributedTestError, run_distributed


def _local_cpu(rank: int) -> torch.Tensor:
    # rank r holds an (r, 3) tensor: rank 0's is empty
    return torch.arange(rank * 3, dtype=torch.float32).reshape(rank, 3) + 100 * rank


def _collectives(config: dict[str, int], device: str = "cpu") -> dict[str, object]:
    ctx = DistributedContext.from_env(DeviceMeshParameters(**config), device=device)
    mesh = ctx.mesh_for("batch")
    r = ctx.rank

    def _local(rank: int) -> torch.Tensor:
        return _local_cpu(rank).to(ctx.device)

    out = {
        "objects": all_gather_object({"rank": r, "name": f"r{r}"}),
        "gathered": all_gather_uneven(_local(r)),
        "gathered_tp": all_gather_uneven(_local(r), mesh, "tp"),
        "to_dst": gather_uneven(_local(r), dst=1),
        "to_dst_dp": gather_uneven(_local(r), dst=0, group=mesh, dim="dp"),
        "sum": reduce_scalar(float(r), "sum"),
        "mean": reduce_scalar(torch.tensor(float(r)), "mean"),
        "max_tp": reduce_scalar(float(r), "max", mesh, "tp"),
        "min_dp": reduce_scalar(float(r), "min", mesh, "dp"),
        "mean_dp_tp": reduce_scalar(float(r), "mean", mesh, ("dp", "tp")),
        "tp_peers": ctx.group_ranks("batch", "tp"),
        "dp_peers": ctx.group_ranks("batch", "dp"),
    }
    ctx.shutdown()
    return out


def check_collectives(config: dict[str, int], backend: str = "gloo", device: str = "cpu") -> None:
    world = DeviceMeshParameters(**config).world_size
    results = run_distributed(_collectives, world, config, device, backend=backend)
    everyone = [_local_cpu(r) for r in range(world)]
    for r, res in enumerate(results):
        assert res["objects"] == [{"rank": q, "name": f"r{q}"} for q in range(world)]
        for got, ref in zip(res["gathered"], everyone, strict=True):
            assert got.shape == ref.shape and torch.equal(got, ref)
        tp_ref = [_local_cpu(q) for q in res["tp_peers"]]
        assert all(torch.equal(a, b) for a, b in zip(res["gathered_tp"], tp_ref, strict=True))
        if r == 1:
            assert all(torch.equal(a, b) for a, b in zip(res["to_dst"], everyone, strict=True))
        else:
            assert res["to_dst"] is None
        dp_peers = res["dp_peers"]
        if dp_peers.index(r) == 0:
            assert [t.shape[0] for t in res["to_dst_dp"]] == dp_peers
        else:
            assert res["to_dst_dp"] is None
        assert res["sum"] == sum(range(world)) and res["mean"] == pytest.approx((world - 1) / 2)
        assert res["max_tp"] == max(res["tp_peers"]) and res["min_dp"] == min(dp_peers)
        assert res["mean_dp_tp"] == pytest.approx((world - 1) / 2)  # pp=cp=1: dp x tp is the world


def test_uneven_gathers_and_scalar_reductions() -> None:
    check_collectives({"data_shard": 2, "tensor": 2})


def test_mixed_dtypes_are_rejected() -> None:
    with pytest.raises(DistributedTestError, match="different dtypes"):
        run_distributed(_mixed_dtypes, 2)


def _mixed_dtypes() -> None:
    t = torch.zeros(2, dtype=torch.float32 if dist.get_rank() == 0 else torch.int64)
    all_gather_uneven(t)
