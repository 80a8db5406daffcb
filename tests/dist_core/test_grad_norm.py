"""Global gradient norm over mixed meshes and pipeline stages equals the single-process norm."""

from __future__ import annotations

import math

import pytest
import torch
from plait.dist_core import DeviceMeshParameters, DistributedContext, clip_grad_norm_, global_grad_norm
from plait.dist_core.testing import run_distributed
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

# (name, pipeline stage, how the gradient is laid out, global shape)
LAYOUTS = [
    ("fsdp_uneven", 0, "fsdp", (3, 4)),  # Shard(0) over dp_cp_shard, 3 rows on 2 ranks
    ("replicated", 0, "replicate", (5,)),  # Replicate over dp_cp_shard
    ("experts", 0, "expert", (4, 2, 3)),  # (Replicate on ep_replicate, Shard(0) on ep_shard)
    # FSDP over EP: (_StridedShard(0) on ep_replicate, Shard(0) on ep_shard), as fully_shard lays out experts
    ("experts_fsdp", 0, "expert_fsdp", (8, 3)),
    ("plain", 0, "plain", (2, 2)),  # plain tensor on every rank of the stage
    ("fsdp_dim1", 1, "fsdp1", (2, 5)),  # Shard(1) on stage 1
    ("experts_s1", 1, "expert", (2, 3)),
    ("plain_s1", 1, "plain", (3,)),
]


def _grads(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=g) for name, _, _, shape in LAYOUTS}


def _mixed_norms(
    config: dict[str, int], grads: dict[str, torch.Tensor], max_norm: float, device: str = "cpu"
) -> dict[str, object]:
    ctx = DistributedContext.from_env(DeviceMeshParameters(**config), device=device)
    stage = ctx.coordinates("batch")["pp"]
    dense = ctx.mesh_for("dense")["dp_cp_shard"]
    expert = ctx.mesh_for("expert")["ep_replicate", "ep_shard"]
    params = []
    for name, s, layout, _ in LAYOUTS:
        if s != stage:
            continue
        g = grads[name].to(ctx.device)
        if layout == "plain":
            p = torch.nn.Parameter(torch.zeros_like(g))
            p.grad = g.clone()
        else:
            mesh, placements = {
                "fsdp": (dense, [Shard(0)]),
                "fsdp1": (dense, [Shard(1)]),
                "replicate": (dense, [Replicate()]),
                "expert": (expert, [Replicate(), Shard(0)]),
                "expert_fsdp": (expert, [_StridedShard(0, split_factor=expert.size(1)), Shard(0)]),
            }[layout]
            p = torch.nn.Parameter(distribute_tensor(torch.zeros_like(g), mesh, placements))
            p.grad = distribute_tensor(g.clone(), mesh, placements)
        params.append((name, p))
    pp_group = ctx.mesh_for("batch").get_group("pp")
    plist = [p for _, p in params]
    out: dict[str, object] = {
        "l2": global_grad_norm(plist, pipeline_group=pp_group).item(),
        "l1": global_grad_norm(plist, 1.0, pipeline_group=pp_group).item(),
        "linf": global_grad_norm(plist, math.inf, pipeline_group=pp_group).item(),
        "l3": global_grad_norm(plist, 3.0, pipeline_group=pp_group).item(),
    }
    out["clip_total"] = clip_grad_norm_(plist, max_norm, pipeline_group=pp_group).item()
    out["clipped"] = {
        name: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad) for name, p in params
    }
    ctx.shutdown()
    return out


def _reference(grads: dict[str, torch.Tensor], p: float) -> float:
    flat = torch.cat([g.double().reshape(-1) for g in grads.values()])
    return float(torch.linalg.vector_norm(flat, p))


@pytest.mark.parametrize(
    "config",
    [
        {"pipeline": 2, "data_shard": 2, "expert": 2},
        {"data_shard": 2, "tensor": 2, "expert": 2},
        {"data_shard": 4, "expert": 2},
    ],
    ids=["pp2-dp2-ep2", "dp2-tp2-ep2", "fsdp4-ep2"],
)
def test_mixed_mesh_norm_equals_single_process(config: dict[str, int]) -> None:
    check_mixed_norms(config)


def check_mixed_norms(config: dict[str, int], backend: str = "gloo", device: str = "cpu") -> None:
    params = DeviceMeshParameters(**config)
    grads = _grads(0)
    max_norm = 1.0
    results = run_distributed(
        _mixed_norms, params.world_size, config, grads, max_norm, device, backend=backend
    )
    present = {name: grads[name] for name, stage, _, _ in LAYOUTS if stage < params.pipeline}
    ref = {k: _reference(present, p) for k, p in [("l2", 2.0), ("l1", 1.0), ("linf", math.inf), ("l3", 3.0)]}
    coef = min(1.0, max_norm / (ref["l2"] + 1e-6))
    for res in results:
        for key, value in ref.items():
            assert res[key] == pytest.approx(value, rel=1e-5), key
        assert res["clip_total"] == pytest.approx(ref["l2"], rel=1e-5)
        assert res["clipped"].keys() <= present.keys()
        for name, g in res["clipped"].items():
            torch.testing.assert_close(g, grads[name] * coef, rtol=1e-5, atol=1e-6)


def test_single_process_plain_tensors_match_torch() -> None:
    ps = [torch.nn.Parameter(torch.zeros(3, 2)) for _ in range(3)]
    for i, p in enumerate(ps):
        p.grad = torch.randn(3, 2) * (i + 1)
    ref = torch.nn.utils.get_total_norm([p.grad for p in ps])
    assert global_grad_norm(ps).item() == pytest.approx(ref.item(), rel=1e-6)
    copies = [torch.nn.Parameter(torch.zeros(3, 2)) for _ in ps]
    for c, p in zip(copies, ps, strict=True):
        c.grad = p.grad.clone()
    torch.nn.utils.clip_grad_norm_(copies, 0.5)  # torch's own clipping as the reference
    clip_grad_norm_(ps, 0.5)
    for p, c in zip(ps, copies, strict=True):
        torch.testing.assert_close(p.grad, c.grad)
    with pytest.raises(ValueError, match="norm_type"):
        global_grad_norm(ps, 0.0)
    bad = torch.nn.Parameter(torch.zeros(1))
    bad.grad = torch.tensor([float("nan")])
    with pytest.raises(RuntimeError, match="non-finite"):
        clip_grad_norm_([bad], 1.0, error_if_nonfinite=True)
