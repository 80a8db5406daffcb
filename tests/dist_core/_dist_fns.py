"""Rank functions shared by the distributed tests (module level so the harness can pickle them)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from plait.dist_core import DOMAIN_DIMS, DeviceMeshParameters, DistributedContext


def context_facts(config: dict[str, int], device: str = "cpu") -> dict[str, object]:
    """What a rank's DistributedContext reports about every domain."""
    ctx = DistributedContext.from_env(DeviceMeshParameters(**config), device=device)
    facts: dict[str, object] = {"rank": ctx.rank, "world_size": ctx.world_size, "main": ctx.is_main_process}
    for domain, dims in DOMAIN_DIMS.items():
        mesh = ctx.mesh_for(domain)
        assert mesh.mesh_dim_names == dims
        facts[domain] = {
            "coordinate": dict(zip(dims, mesh.get_coordinate() or [], strict=True)),
            "ctx_coordinate": ctx.coordinates(domain),
            "groups": {d: dist.get_process_group_ranks(mesh.get_group(d)) for d in dims},
            "ctx_groups": {d: ctx.group_ranks(domain, d) for d in dims},
        }
    # the mesh groups really talk: sum of ranks along tp of the batch domain
    t = torch.tensor([float(ctx.rank)], device=ctx.device)
    dist.all_reduce(t, group=ctx.mesh_for("batch").get_group("tp"))
    facts["tp_sum"] = t.item()
    facts["prefix"] = ctx.logger.extra["prefix"]  # type: ignore[index]
    ctx.shutdown()
    facts["still_initialised"] = dist.is_initialized()  # the harness's group is reused, not destroyed
    return facts


def _dp_rest_layout(p: DeviceMeshParameters) -> torch.Tensor:
    # (pp, dp, cp, tp) -> (dp, pp * cp * tp): the data-parallel ranks in one dimension, everything else in the other
    return torch.arange(p.world_size).reshape(p.pipeline, p.data, -1).movedim(1, 0).reshape(p.data, -1)


def registered_domain_facts(config: dict[str, int]) -> dict[str, object]:
    """A domain registered by the user: its mesh, its groups, a collective over it, and the errors."""
    from plait.dist_core import register_mesh_domain, unregister_mesh_domain

    register_mesh_domain("dp_rest", ("dp", "rest"), _dp_rest_layout)
    try:
        ctx = DistributedContext.from_env(DeviceMeshParameters(**config), device="cpu")
        mesh = ctx.mesh_for("dp_rest")
        t = torch.tensor([float(ctx.rank)])
        dist.all_reduce(t, group=mesh.get_group("dp"))
        facts: dict[str, object] = {
            "dims": mesh.mesh_dim_names,
            "dp_group": dist.get_process_group_ranks(mesh.get_group("dp")),
            "ctx_dp_group": ctx.group_ranks("dp_rest", "dp"),
            "dp_sum": t.item(),
            "batch_dp_group": ctx.group_ranks("batch", "dp"),
        }
        ctx.wait_world()
        ctx.shutdown()
    finally:
        unregister_mesh_domain("dp_rest")
    return facts
