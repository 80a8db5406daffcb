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
