"""DeepEPDispatcher's autograd wiring, with a single-rank stand-in for ``deep_ep.Buffer``.

With one rank DeepEP's dispatch receives every token with its routing unchanged and combine is the
identity, so the dispatcher must reproduce the local path exactly. (Real DeepEP needs CUDA+NVSHMEM.)
"""

from __future__ import annotations

import sys
import types
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from plait.dist_core.testing import run_distributed
from plait.moe import DeepEPDispatcher, MoELayer, RouterConfig


class _FakeConfig:
    def get_nvl_buffer_size_hint(self, hidden_bytes: int, n: int) -> int:
        return 0

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, n: int) -> int:
        return 0


class _FakeBuffer:
    calls: ClassVar[list[str]] = []

    def __init__(self, group: Any, nvl: int, rdma: int) -> None:
        assert dist.get_world_size(group) == 1

    @staticmethod
    def get_dispatch_config(n: int) -> _FakeConfig:
        return _FakeConfig()

    get_combine_config = get_dispatch_config

    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int) -> tuple[Any, ...]:
        counts = torch.zeros(num_experts, dtype=torch.int64).scatter_add_(
            0, topk_idx[topk_idx >= 0], torch.ones_like(topk_idx[topk_idx >= 0])
        )
        return None, None, counts, None, None

    def dispatch(self, x: torch.Tensor, handle: Any = None, **kw: Any) -> tuple[Any, ...]:
        _FakeBuffer.calls.append("dispatch")
        if handle is not None:  # backward of combine
            return x, None, None, None, handle, None
        return x.clone(), kw["topk_idx"], kw["topk_weights"], kw["num_tokens_per_expert"].tolist(), "h", None

    def combine(
        self, x: torch.Tensor, handle: Any, topk_weights: torch.Tensor | None = None
    ) -> tuple[Any, ...]:
        _FakeBuffer.calls.append("combine")
        return x.clone(), topk_weights, None


def _worker() -> tuple[list[torch.Tensor], list[torch.Tensor], list[str]]:
    sys.modules["deep_ep"] = types.SimpleNamespace(Buffer=_FakeBuffer)  # type: ignore[assignment]
    try:
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
        return results[0], results[1], _FakeBuffer.calls
    finally:
        del sys.modules["deep_ep"]


def test_deepep_dispatcher_wiring_single_rank() -> None:
    (local, deepep, calls) = run_distributed(_worker, 1)[0]
    for a, b in zip(deepep, local):
        torch.testing.assert_close(a, b)
    assert calls == [
        "dispatch",
        "combine",
        "dispatch",
        "combine",
    ]  # fwd dispatch, fwd combine, their backwards
