"""The gated RMSNorm on gated DeltaNet's output: ``rms_norm(o) * weight * silu(z)`` per head."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from plait.kernels import rms_norm
from plait.models.common._comm import all_reduce_backward
from torch import nn

__all__ = ["GatedRMSNorm"]


class GatedRMSNorm(nn.Module):
    """``y = x / rms(x) * weight * silu(gate)`` over the last dimension, statistics and gate in fp32.

    Args:
        dim: Normalised (last) dimension (a value head's width; the weight is shared by the heads).
        eps: Epsilon added to the mean square.

    Attributes:
        grad_reduce_group: Set when this norm sees only a shard of the heads: the weight gradient is
            then summed over that group.
    """

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.grad_reduce_group: dist.ProcessGroup | None = None

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """``x``, ``gate`` ``[..., dim]`` -> ``[..., dim]`` in ``x``'s dtype."""
        weight = all_reduce_backward(self.weight, self.grad_reduce_group)
        y = rms_norm(x, weight, eps=self.eps)
        assert isinstance(y, torch.Tensor)
        return (y * F.silu(gate.float())).to(x.dtype)

    def reset_parameters(self) -> None:
        """Unit weight."""
        nn.init.ones_(self.weight)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
