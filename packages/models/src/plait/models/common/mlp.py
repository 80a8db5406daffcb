"""SwiGLU feed-forward on plait's fused activation kernel."""

from __future__ import annotations

import torch
from plait.kernels import swiglu
from torch import nn

__all__ = ["SwiGLUMLP"]


class SwiGLUMLP(nn.Module):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))`` (Qwen3 / Llama MLP; HF parameter names).

    gate/up stay separate linears so the tensor-parallel plan can shard them column-wise
    independently; the activation is the fused ``plait.kernels.swiglu``.

    Args:
        hidden_size: Model width.
        intermediate_size: SwiGLU width.
        bias: Bias on the three projections (Llama's ``mlp_bias``).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., H]`` -> ``[..., H]``."""
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))

    def reset_parameters(self, std: float) -> None:
        """Normal(0, std) weights, zero biases."""
        for lin in (self.gate_proj, self.up_proj, self.down_proj):
            nn.init.normal_(lin.weight, 0.0, std)
            if lin.bias is not None:
                nn.init.zeros_(lin.bias)
