"""Collective helpers with per-rank shapes and scalar reductions over mesh dimensions (4 CPU ranks)."""

from __future__ import annotations

import torch

from plait.dist_core import (
    DeviceMeshParameters,
    DistributedContext,
    all_gather_object,
    all_gather_uneven,
    gather_uneven,
    reduce_scalar,
)
from plait.dist_core.testing import run_distributed


def _local(rank: int) -> torch.Tensor:
    # rank r holds an (r, 3) tensor: rank 0's is empty
    return torch.arange(rank * 3, dtype=torch.float32).reshape(rank, 3) + 100 * rank


def _collectives() -> dict[str, object]:
    ctx = DistributedContext.from_env(DeviceMeshParameters(data_shard=2, tensor=2), device="cpu")
    mesh = ctx.mesh_for("batch")
    r = ctx.rank
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


def test_uneven_gathers_and_scalar_reductions() -> None:
    results = run_distributed(_collectives, 4)
    everyone = [_local(r) for r in range(4)]
    for r, res in enumerate(results):
        assert res["objects"] == [{"rank": q, "name": f"r{q}"} for q in range(4)]
        for got, ref in zip(res["gathered"], everyone, strict=True):
            assert got.shape == ref.shape and torch.equal(got, ref)
        tp_ref = [_local(q) for q in res["tp_peers"]]
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
        assert res["sum"] == 6.0 and res["mean"] == 1.5
        assert res["max_tp"] == max(res["tp_peers"]) and res["min_dp"] == min(dp_peers)
        assert res["mean_dp_tp"] == 1.5


def test_mixed_dtypes_are_rejected() -> None:
    import pytest

    from plait.dist_core.testing import DistributedTestError

    with pytest.raises(DistributedTestError, match="different dtypes"):
        run_distributed(_mixed_dtypes, 2)


def _mixed_dtypes() -> None:
    import torch.distributed as dist

    t = torch.zeros(2, dtype=torch.float32 if dist.get_rank() == 0 else torch.int64)
    all_gather_uneven(t)
