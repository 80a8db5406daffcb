"""RMSNorm on plait's fused kernel."""

from __future__ import annotations

import torch
import torch.distributed as dist
from plait.kernels import rms_norm
from plait.models.common._comm import all_reduce_backward
from torch import nn

__all__ = ["RMSNorm"]


class RMSNorm(nn.Module):
    """``y = x / rms(x) * weight`` with fp32 statistics (``plait.kernels.rms_norm``).

    Args:
        dim: Normalised (last) dimension.
        eps: Epsilon added to the mean square.

    Attributes:
        grad_reduce_group: Set by the tensor-parallel plan when this norm sees only a shard of the
            heads (q/k norms): the weight gradient is then summed over that group.
    """

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.grad_reduce_group: dist.ProcessGroup | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise ``x`` (use :meth:`forward_residual` for the fused residual add)."""
        weight = all_reduce_backward(self.weight, self.grad_reduce_group)
        out = rms_norm(x, weight, eps=self.eps)
        assert isinstance(out, torch.Tensor)
        return out

    def forward_residual(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Fused ``h = x + residual``; returns ``(rms_norm(h), h)``."""
        weight = all_reduce_backward(self.weight, self.grad_reduce_group)
        out, h = rms_norm(x, weight, eps=self.eps, residual=residual)
        return out, h

    def reset_parameters(self) -> None:
        """Unit weight."""
        nn.init.ones_(self.weight)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
