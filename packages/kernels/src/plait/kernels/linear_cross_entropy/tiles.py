"""The per-tile elementwise steps of linear cross-entropy: PyTorch versions here, Triton versions in
``plait.kernels._triton.linear_cross_entropy``."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["tile_grad_torch", "tile_ops", "tile_stats_torch"]


def tile_stats_torch(
    logits: torch.Tensor,
    local_t: torch.Tensor,
    m: torch.Tensor,
    s: torch.Tensor,
    tgt: torch.Tensor,
    softcap: float | None,
) -> None:
    """Fold one logit tile into the running max, sum-exp and target logit per token, in place."""
    z = logits.float()
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    new_m = torch.maximum(m, z.max(1).values)
    s.mul_(torch.exp(m - new_m)).add_(torch.exp(z - new_m[:, None]).sum(1))
    m.copy_(new_m)
    inside = (local_t >= 0) & (local_t < z.shape[1])
    tgt.add_(torch.where(inside, z.gather(1, local_t.clamp(0, z.shape[1] - 1)[:, None]).squeeze(1), 0.0))


def tile_grad_torch(
    logits: torch.Tensor,
    local_t: torch.Tensor,
    lse: torch.Tensor,
    g_p: torch.Tensor,
    g_t: torch.Tensor,
    softcap: float | None,
) -> torch.Tensor:
    """Turn one logit tile into ``dlogits`` in place (``g_p * softmax - g_t * onehot``, soft-cap aware)."""
    # dlogit_j = g_p * softmax_j - g_t * onehot_j  (times d softcap / d logit)
    z = logits.float()
    if softcap is not None:
        th = torch.tanh(z / softcap)
        z = softcap * th
    d = torch.exp(z - lse[:, None]) * g_p[:, None]
    inside = (local_t >= 0) & (local_t < z.shape[1])
    idx = local_t.clamp(0, z.shape[1] - 1)[:, None]
    d.scatter_add_(1, idx, torch.where(inside, -g_t, 0.0)[:, None])
    if softcap is not None:
        d = d * (1.0 - th * th)
    return logits.copy_(d)  # in place, like the Triton kernel


def tile_ops(triton: bool) -> tuple[Any, Any]:
    """The (stats, grad) tile steps: Triton kernels or the PyTorch versions."""
    if triton:
        from plait.kernels._triton.linear_cross_entropy import tile_grad_triton, tile_stats_triton

        return tile_stats_triton, tile_grad_triton
    return tile_stats_torch, tile_grad_torch
