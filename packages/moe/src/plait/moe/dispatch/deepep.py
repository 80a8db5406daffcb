"""Expert-parallel dispatch through DeepEP's normal-mode kernels (optional extra ``plait-moe[deepep]``).

DeepEP sends each token once per destination rank (not once per expert) over NVLink/RDMA and returns,
per received token, the routing restricted to this rank's experts (local ids, -1 elsewhere). The rank
then permutes its received assignments by local expert (``plait.kernels.permute``), runs the grouped
GEMM, sums each token's local expert outputs, and DeepEP's ``combine`` sums the per-rank partial results back on the source rank.
Backward is the mirror image: ``combine`` of the gradients for dispatch, ``dispatch`` for combine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from plait.kernels import permute, unpermute
from torch import Tensor

if TYPE_CHECKING:
    from plait.moe.experts import GroupedExperts


def _import_deep_ep() -> Any:
    try:
        import deep_ep
    except ImportError as e:
        raise ImportError(
            "The DeepEP dispatch backend needs the `deep_ep` package: install `plait-moe[deepep]` "
            "(DeepEP builds against CUDA and NVSHMEM; see https://github.com/deepseek-ai/DeepEP)."
        ) from e
    return deep_ep


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, weights: Tensor, topk_idx: Tensor, owner: DeepEPDispatcher) -> Any:
        buf = owner.buffer_for(x)
        n_rank, n_rdma, n_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx, owner.num_experts)
        recv_x, recv_idx, recv_w, recv_counts, handle, _ = buf.dispatch(
            x,
            topk_idx=topk_idx,
            topk_weights=weights,
            num_tokens_per_rank=n_rank,
            num_tokens_per_rdma_rank=n_rdma,
            is_token_in_rank=in_rank,
            num_tokens_per_expert=n_expert,
        )
        ctx.owner, ctx.handle = owner, handle
        ctx.mark_non_differentiable(recv_idx)
        return recv_x, recv_w, recv_idx, handle, list(recv_counts)

    @staticmethod
    def backward(ctx: Any, g_x: Tensor, g_w: Tensor, *_: Any) -> tuple[Tensor, Tensor, None, None]:
        buf = ctx.owner.buffer_for(g_x)
        grad_x, grad_w, _ = buf.combine(g_x.contiguous(), ctx.handle, topk_weights=g_w.contiguous())
        return grad_x, grad_w, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, y: Tensor, handle: Any, owner: DeepEPDispatcher) -> Tensor:
        ctx.owner, ctx.handle = owner, handle
        out, _, _ = owner.buffer_for(y).combine(y, handle)
        return out  # type: ignore[no-any-return]

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        g, *_ = ctx.owner.buffer_for(grad).dispatch(grad.contiguous(), handle=ctx.handle)
        return g, None, None


class DeepEPDispatcher:
    """DeepEP normal-mode (high-throughput) dispatcher over an expert-parallel group.

    Args:
        group: The expert-parallel process group (NCCL, CUDA tensors).
        num_experts: Global number of experts.

    Raises:
        ImportError: naming ``plait-moe[deepep]`` when DeepEP is not installed.
    """

    def __init__(self, group: dist.ProcessGroup, num_experts: int) -> None:
        self._deep_ep = _import_deep_ep()
        self.group = group
        self.num_experts = num_experts
        self.ep_size = dist.get_world_size(group)
        self._buffer: Any = None
        self._hidden_bytes = 0

    def buffer_for(self, x: Tensor) -> Any:
        """The communication buffer, (re)allocated for rows of ``x``'s size (DeepEP's sizing recipe)."""
        hidden_bytes = x.shape[-1] * max(x.element_size(), 2)
        if self._buffer is None or hidden_bytes > self._hidden_bytes:
            buffer_cls = self._deep_ep.Buffer
            nvl, rdma = 0, 0
            for cfg in (
                buffer_cls.get_dispatch_config(self.ep_size),
                buffer_cls.get_combine_config(self.ep_size),
            ):
                nvl = max(nvl, cfg.get_nvl_buffer_size_hint(hidden_bytes, self.ep_size))
                rdma = max(rdma, cfg.get_rdma_buffer_size_hint(hidden_bytes, self.ep_size))
            self._buffer = buffer_cls(self.group, nvl, rdma)
            self._hidden_bytes = hidden_bytes
        return self._buffer

    def __call__(
        self,
        x: Tensor,
        topk_idx: Tensor,
        topk_weights: Tensor,
        experts: GroupedExperts,
        has_dropped: bool = False,
    ) -> Tensor:
        num_experts = experts.num_experts
        n_local = num_experts // self.ep_size
        idx = topk_idx.masked_fill(topk_idx >= num_experts, -1) if has_dropped else topk_idx
        recv_x, recv_w, recv_idx, handle, _recv_counts = _Dispatch.apply(
            x, topk_weights.float(), idx.to(torch.int64), self
        )
        # recv_idx holds local expert ids, -1 for experts of other ranks: permute skips those.
        rows, row_w, row_map, counts = permute(recv_x, recv_idx, n_local, recv_w)
        assert row_w is not None
        partial = unpermute(experts(rows, counts, row_w.to(x.dtype)), row_map)
        return _Combine.apply(partial, handle, self)  # type: ignore[no-any-return]

    def __repr__(self) -> str:
        return f"DeepEPDispatcher(ep_size={self.ep_size})"
