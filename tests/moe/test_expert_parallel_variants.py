"""Expert parallelism (gloo, CPU) for the gpt-oss and DeepSeek-V3 style layers, and the aux-loss-free
selection bias: evening out a skewed router, and one bias on every rank under EP x data parallelism.

Parallel runs are checked against the single-process float64 layer (itself checked against
transformers in test_hf_block_parity.py); the bias against a plain top-k/bincount replay.
"""

from __future__ import annotations

from typing import Any, Literal

import pytest
import torch
import torch.distributed as dist
from plait.dist_core.testing import run_distributed
from plait.moe import (
    ClampedSwiGLU,
    MoELayer,
    RouterConfig,
    expert_parallel,
    register_expert_bias_hook,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

H, FFN, E, T = 8, 6, 8, 12
Variant = Literal["clamped_bias", "grouped_sigmoid"]


def _make_layer(variant: Variant, seed: int) -> MoELayer:
    torch.manual_seed(seed)
    if variant == "clamped_bias":
        layer = MoELayer(
            H,
            FFN,
            E,
            RouterConfig(score_func="softmax_over_topk", logit_bias=True, top_k=3, aux_loss_coef=0.05),
            expert_activation=ClampedSwiGLU(alpha=1.702, limit=0.6),
            expert_proj_bias=True,
        )
    else:
        router = RouterConfig(
            score_func="sigmoid",
            fp32_logits=True,
            top_k=3,
            norm_topk_prob=True,
            scaling_factor=2.5,
            n_groups=4,
            topk_groups=2,
            group_score="top2_sum",
            seq_aux_loss_coef=0.01,
            bias_update_rate=0.01,
        )
        layer = MoELayer(H, FFN, E, router, shared_expert_intermediate_size=2 * FFN)
        assert layer.router.expert_bias is not None
        with torch.no_grad():
            layer.router.expert_bias.copy_(torch.randn(E) * 0.3)
    return layer


def _inputs(world: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed + 1)
    return torch.randn(world, T, H, generator=g), torch.randn(world, T, H, generator=g)


def _ep_worker(variant: Variant, seed: int, backend: str) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    layer = _make_layer(variant, seed)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    if backend == "all_gather_bounded":  # a bounded expert buffer: 54 of the exact 72 rows
        expert_parallel(layer, mesh, backend="all_gather", buffer_factor=1.5)
    else:
        expert_parallel(layer, mesh, backend=backend)  # type: ignore[arg-type]
    for name, p in layer.experts.named_parameters():
        assert isinstance(p, DTensor) and p.placements == (Shard(0),), name
    x_all, g_all = _inputs(world, seed)
    x = x_all[rank].requires_grad_()
    out = layer(x)
    ((out.hidden_states * g_all[rank]).sum() + out.aux_loss).backward()
    grads = {
        n: (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).clone()
        for n, p in layer.named_parameters()
    }
    return {"y": out.hidden_states.detach(), "gx": x.grad, "aux": out.aux_loss.detach(), "grads": grads}


@pytest.mark.parametrize("backend", ["all_to_all", "all_gather", "all_gather_bounded"])
@pytest.mark.parametrize("variant", ["clamped_bias", "grouped_sigmoid"])
def test_ep2_variant_matches_single_process(variant: Variant, backend: str) -> None:
    world, seed = 2, 21
    results = run_distributed(_ep_worker, world, variant, seed, backend)
    ref = _make_layer(variant, seed).double()
    x_all, g_all = _inputs(world, seed)
    for rank, res in enumerate(results):
        x = x_all[rank].double().requires_grad_()
        out = ref(x)
        ((out.hidden_states * g_all[rank].double()).sum() + out.aux_loss).backward()
        torch.testing.assert_close(res["y"].double(), out.hidden_states.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(res["aux"].double(), out.aux_loss.detach().double(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(res["gx"].double(), x.grad, rtol=1e-5, atol=1e-5, msg=f"rank {rank}")
    for name, p in ref.named_parameters():
        if name.startswith("experts."):
            got = torch.cat([r["grads"][name] for r in results])  # each rank owns a slice of experts
        else:
            got = sum(r["grads"][name] for r in results)  # replicated: per-rank partial sums
        assert p.grad is not None and got.shape == p.grad.shape, name
        torch.testing.assert_close(got.double(), p.grad, rtol=1e-4, atol=1e-5, msg=name)


def _route(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, k: int) -> torch.Tensor:
    """Assignments per expert of plain (ungrouped) sigmoid top-k with a selection bias."""
    idx = torch.topk(torch.sigmoid(x @ weight.T) + bias, k, dim=-1).indices
    return torch.bincount(idx.flatten(), minlength=weight.shape[0])


def _skewed_layer(rate: float) -> MoELayer:
    torch.manual_seed(5)
    layer = MoELayer(16, 4, E, RouterConfig(score_func="sigmoid", top_k=2, bias_update_rate=rate))
    with torch.no_grad():
        layer.router.weight.normal_(0.0, 0.25)
        layer.router.weight[:2, 0] = 4.0  # experts 0 and 1 take (almost) every token
    return layer


def _skewed_tokens(step: int, n: int = 128) -> torch.Tensor:
    x = torch.randn(n, 16, generator=torch.Generator().manual_seed(1000 + step))
    x[:, 0] = x[:, 0].abs() + 1.0
    return x


def _load_spread(layer: MoELayer) -> tuple[float, float]:
    """(max, min) expert load over the mean load, on 4096 held-out tokens (eval: not counted)."""
    layer.eval()
    counts = layer(_skewed_tokens(-999, n=4096)).tokens_per_expert.float()
    layer.train()
    return float(counts.max() / counts.mean()), float(counts.min() / counts.mean())


def test_bias_evens_out_a_skewed_router() -> None:
    rate, k, steps = 0.05, 2, 40
    layer = _skewed_layer(rate)
    most, least = _load_spread(layer)
    assert most > 3.9 and least == 0.0  # experts 0 and 1 take (almost) every token
    opt = torch.optim.SGD(layer.parameters(), lr=0.0)
    register_expert_bias_hook(opt, layer)
    bias = torch.zeros(E)
    for step in range(steps):
        x = _skewed_tokens(step)
        out = layer(x)
        counts = _route(x, layer.router.weight.detach(), bias, k)
        assert torch.equal(out.tokens_per_expert, counts), step
        out.hidden_states.square().mean().backward()
        opt.step()  # the hook applies bias += rate * sign(mean load - load)
        opt.zero_grad()
        bias += rate * torch.sign(counts.float().mean() - counts.float())
        torch.testing.assert_close(layer.router.expert_bias, bias)
    most, least = _load_spread(layer)
    assert most < 1.5 and least > 0.5, (most, least)


def _bias_worker(rate: float, steps: int) -> dict[str, Any]:
    """Mesh (dp=2, ep=2): experts sharded over ep, the router replicated on all 4 ranks, each rank
    routing its own tokens; the counts are summed over the whole mesh (every rank that routes)."""
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    layer = _skewed_layer(rate)
    expert_parallel(layer, mesh["ep"])
    for step in range(steps):
        x = _skewed_tokens(step * 4 + rank, n=32)
        out = layer(x)
        out.hidden_states.square().mean().backward()
        layer.update_expert_bias(mesh)
    assert layer.router.expert_bias is not None
    return {"bias": layer.router.expert_bias.clone()}


def test_bias_identical_on_every_rank_under_ep_and_data_parallel() -> None:
    rate, k, steps = 0.05, 2, 6
    results = run_distributed(_bias_worker, 4, rate, steps)
    weight = _skewed_layer(rate).router.weight.detach()
    bias = torch.zeros(E)
    for step in range(steps):
        counts = sum(_route(_skewed_tokens(step * 4 + r, n=32), weight, bias, k) for r in range(4))
        assert isinstance(counts, torch.Tensor)
        bias = bias + rate * torch.sign(counts.float().mean() - counts.float())
    assert bias.abs().sum() > 0
    for rank, res in enumerate(results):
        assert torch.equal(res["bias"], results[0]["bias"]), f"rank {rank} holds another bias"
        torch.testing.assert_close(res["bias"], bias, msg=f"rank {rank}")
