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
        offset: Added to ``weight`` in the forward: ``1.0`` stores the scale zero-centred
            (``y = x / rms(x) * (1 + weight)``, Gemma's and the gated-DeltaNet hybrids' norms), so
            the stored weight starts at 0 and weight decay pulls the scale towards 1.

    Attributes:
        grad_reduce_group: Set by the tensor-parallel plan when this norm sees only a shard of the
            heads (q/k norms): the weight gradient is then summed over that group.
    """

    def __init__(self, dim: int, eps: float = 1e-6, offset: float = 0.0) -> None:
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.weight = nn.Parameter(torch.full((dim,), 1.0 - offset))
        self.grad_reduce_group: dist.ProcessGroup | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise ``x`` (use :meth:`forward_residual` for the fused residual add)."""
        weight = all_reduce_backward(self.weight, self.grad_reduce_group)
        out = rms_norm(x, weight, eps=self.eps, offset=self.offset)
        assert isinstance(out, torch.Tensor)
        return out

    def forward_residual(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Fused ``h = x + residual``; returns ``(rms_norm(h), h)``."""
        weight = all_reduce_backward(self.weight, self.grad_reduce_group)
        out, h = rms_norm(x, weight, eps=self.eps, offset=self.offset, residual=residual)
        return out, h

    def reset_parameters(self) -> None:
        """Unit scale (weight ``1 - offset``)."""
        nn.init.constant_(self.weight, 1.0 - self.offset)

    def extra_repr(self) -> str:
        extra = f", offset={self.offset}" if self.offset else ""
        return f"{self.weight.shape[0]}, eps={self.eps}{extra}"
