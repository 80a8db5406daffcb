"""DeepEPDispatcher's autograd wiring, run on gloo through a stand-in for ``deep_ep.Buffer``.

Real DeepEP needs CUDA + NVSHMEM and cannot be built here; ``_fake_deep_ep.FakeBuffer`` follows its
normal-mode API and semantics over ``all_to_all_single``. With it the dispatcher must reproduce the
local path (one rank) and the single-process float64 reference (EP=2, EP=4 with dropping), values
and gradients, exactly as the all-to-all backend does.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from plait.dist_core.testing import run_distributed
from plait.moe import DeepEPDispatcher, MoELayer, RouterConfig

from ._fake_deep_ep import fake_deep_ep
from .test_expert_parallel import _check


def _worker() -> tuple[list[torch.Tensor], list[torch.Tensor], list[str]]:
    with fake_deep_ep() as buffer:
        torch.manual_seed(0)
        layer = MoELayer(8, 6, 4, RouterConfig(top_k=2, norm_topk_prob=True), capacity_factor=0.75)
        x = torch.randn(10, 8)
        results = []
        for dispatcher in (None, DeepEPDispatcher(dist.group.WORLD, 4)):
            if dispatcher is not None:
                layer.dispatcher = dispatcher
            layer.zero_grad()
            xx = x.clone().requires_grad_()
            y = layer(xx).hidden_states
            (y * torch.arange(8)).sum().backward()
            results.append(
                [y.detach(), xx.grad, layer.router.weight.grad.clone(), layer.experts.down_proj.grad.clone()]
            )
        return results[0], results[1], list(buffer.calls)


def test_deepep_dispatcher_wiring_single_rank() -> None:
    (local, deepep, calls) = run_distributed(_worker, 1)[0]
    for a, b in zip(deepep, local):
        torch.testing.assert_close(a, b)
    # fwd dispatch, fwd combine, then their backwards (combine's backward is a cached dispatch)
    assert calls == ["dispatch", "combine", "dispatch", "combine"]


def test_deepep_ep2_matches_reference() -> None:
    _check(
        2,
        seed=0,
        layer_kwargs={"shared_expert_intermediate_size": 5, "shared_expert_gate": True},
        router_kwargs={"top_k": 2, "norm_topk_prob": True, "aux_loss_coef": 0.05},
        dispatch="deepep",
    )
    # Every token picks expert 5 (rank 1): rank 0 sends and receives nothing.
    _check(2, seed=1, layer_kwargs={}, router_kwargs={"top_k": 1}, one_hot_expert=5, dispatch="deepep")


def test_deepep_ep4_dropping_matches_reference() -> None:
    _check(
        4,
        seed=3,
        layer_kwargs={"capacity_factor": 1.0, "drop_policy": "position"},
        router_kwargs={"top_k": 3, "aux_loss_coef": 0.1},
        dispatch="deepep",
    )
