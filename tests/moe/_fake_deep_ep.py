"""A stand-in for DeepEP's ``deep_ep.Buffer`` (normal mode) over ``torch.distributed``, for CPU tests.

It follows the call signatures and return values of DeepEP's ``Buffer`` (``deep_ep/buffer.py``:
``get_dispatch_config``/``get_combine_config`` with size hints, ``get_dispatch_layout``,
``dispatch`` in both layout and cached-handle modes, ``combine``) and the intranode kernels'
semantics:

- ``dispatch`` sends each token once to every rank that holds at least one of its experts (in
  source-rank, then token order), with its top-k ids rewritten to that rank's local expert ids
  (-1 where the expert lives elsewhere) and the matching weights zeroed, and returns the number of
  received assignments per local expert;
- ``dispatch(x, handle=h)`` repeats a previous layout (no routing);
- ``combine(x, handle, topk_weights)`` sends each received row back and *sums* the rows (and
  weights) arriving for the same source token, without weighting.

The transport is ``all_to_all_single`` (gloo on CPU) instead of NVLink/RDMA kernels, and any dtype
is accepted (DeepEP itself takes bf16 or fp8 rows and fp32 weights).
"""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import Tensor


class FakeConfig:
    """``deep_ep.Config``: only the buffer size hints are used by plait."""

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        return 0

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        return 0


@dataclass(frozen=True)
class _Handle:
    src_token: Tensor  # [n_sent] source token of each sent row, grouped by destination rank
    send_splits: list[int]
    recv_splits: list[int]
    num_tokens: int


class FakeBuffer:
    """``deep_ep.Buffer(group, num_nvl_bytes, num_rdma_bytes)``; ``calls`` logs dispatch/combine."""

    calls: ClassVar[list[str]] = []

    def __init__(self, group: dist.ProcessGroup, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0) -> None:
        self.group = group
        self.rank = group.rank()
        self.group_size = group.size()

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> FakeConfig:
        return FakeConfig()

    @staticmethod
    def get_combine_config(num_ranks: int) -> FakeConfig:
        return FakeConfig()

    def get_dispatch_layout(
        self,
        topk_idx: Tensor,
        num_experts: int,
        previous_event: Any = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> tuple[Tensor, None, Tensor, Tensor, None]:
        assert topk_idx.dtype == torch.int64, "DeepEP takes int64 top-k ids"
        n_local = num_experts // self.group_size
        valid = topk_idx >= 0
        dest = torch.where(valid, topk_idx // n_local, self.group_size)
        is_token_in_rank = torch.zeros(topk_idx.shape[0], self.group_size + 1, dtype=torch.bool)
        is_token_in_rank.scatter_(1, dest, True)
        is_token_in_rank = is_token_in_rank[:, : self.group_size]
        per_rank = is_token_in_rank.sum(0).int()
        per_expert = torch.bincount(topk_idx[valid], minlength=num_experts).int()
        return per_rank, None, per_expert, is_token_in_rank, None

    def _exchange(self, rows: Tensor, send_splits: list[int], recv_splits: list[int]) -> Tensor:
        out = rows.new_empty((sum(recv_splits), *rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), recv_splits, send_splits, group=self.group)
        return out

    def dispatch(
        self,
        x: Tensor,
        handle: _Handle | None = None,
        num_tokens_per_rank: Tensor | None = None,
        num_tokens_per_rdma_rank: Tensor | None = None,
        is_token_in_rank: Tensor | None = None,
        num_tokens_per_expert: Tensor | None = None,
        topk_idx: Tensor | None = None,
        topk_weights: Tensor | None = None,
        expert_alignment: int = 1,
        config: Any = None,
        previous_event: Any = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> tuple[Any, ...]:
        FakeBuffer.calls.append("dispatch")
        assert expert_alignment == 1
        if handle is not None:  # cached mode: same layout, rows only
            assert topk_idx is None and topk_weights is None
            recv_x = self._exchange(x[handle.src_token], handle.send_splits, handle.recv_splits)
            return recv_x, None, None, None, None, None
        assert num_tokens_per_rank is not None and is_token_in_rank is not None
        assert num_tokens_per_expert is not None and topk_idx is not None and topk_weights is not None
        assert topk_weights.dtype == torch.float32, "DeepEP takes fp32 top-k weights"
        ranks = self.group_size
        n_local = num_tokens_per_expert.numel() // ranks
        dest, src_token = is_token_in_rank.t().nonzero(as_tuple=True)  # by destination, then token
        send_splits = num_tokens_per_rank.tolist()
        recv_splits_t = torch.empty(ranks, dtype=torch.int64)
        dist.all_to_all_single(recv_splits_t, num_tokens_per_rank.long(), group=self.group)
        recv_splits = recv_splits_t.tolist()
        local = topk_idx[src_token] - dest[:, None] * n_local
        mine = (topk_idx[src_token] >= 0) & (local >= 0) & (local < n_local)
        send_idx = torch.where(mine, local, -1)
        send_w = torch.where(mine, topk_weights[src_token], 0.0)
        recv_x = self._exchange(x[src_token], send_splits, recv_splits)
        recv_idx = self._exchange(send_idx, send_splits, recv_splits)
        recv_w = self._exchange(send_w, send_splits, recv_splits)
        per_expert = torch.empty(ranks * n_local, dtype=torch.int64)
        dist.all_to_all_single(per_expert, num_tokens_per_expert.long(), group=self.group)
        per_local_expert = per_expert.view(ranks, n_local).sum(0).tolist()
        handle = _Handle(src_token, send_splits, recv_splits, x.shape[0])
        return recv_x, recv_idx, recv_w, per_local_expert, handle, None

    def combine(
        self,
        x: Tensor,
        handle: _Handle,
        topk_weights: Tensor | None = None,
        config: Any = None,
        previous_event: Any = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> tuple[Tensor, Tensor | None, None]:
        FakeBuffer.calls.append("combine")

        def reduce(rows: Tensor) -> Tensor:
            back = self._exchange(rows, handle.recv_splits, handle.send_splits)
            out = back.new_zeros((handle.num_tokens, *back.shape[1:]))
            return out.index_add_(0, handle.src_token, back)

        return reduce(x), None if topk_weights is None else reduce(topk_weights), None


@contextmanager
def fake_deep_ep() -> Iterator[type[FakeBuffer]]:
    """Make ``import deep_ep`` return a module whose ``Buffer`` is :class:`FakeBuffer` (calls reset)."""
    FakeBuffer.calls.clear()
    sys.modules["deep_ep"] = types.SimpleNamespace(Buffer=FakeBuffer)  # type: ignore[assignment]
    try:
        yield FakeBuffer
    finally:
        del sys.modules["deep_ep"]
