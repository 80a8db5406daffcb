"""Grouped SwiGLU experts and the shared expert."""

from __future__ import annotations

import math

import torch
from plait.kernels import gmm, swiglu, swiglu_fused
from torch import Tensor, nn
from torch.distributed.tensor import DTensor


def local_tensor(t: Tensor) -> Tensor:
    """The local shard of a DTensor parameter (differentiable), or the tensor itself."""
    # isinstance, not getattr(t, "to_local", None): torch.compile traces the former (the latter gave
    # the global shape under Dynamo).
    return t.to_local() if isinstance(t, DTensor) else t


class GroupedExperts(nn.Module):
    """E SwiGLU FFNs stored as stacked weights, computed with one grouped GEMM per projection.

    Parameters (Hugging Face Qwen3-MoE layout): ``gate_up_proj`` ``[E, 2I, H]`` (gate rows first) and
    ``down_proj`` ``[E, H, I]``. Under expert parallelism both are DTensors ``Shard(0)`` and this
    module computes its local experts only.
    """

    # Calls adapters in ``self.lora`` after each grouped GEMM (see plait.peft's expert LoRA).
    calls_expert_adapters = True

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """nn.Linear's default (uniform +-1/sqrt(fan_in)) init, per expert."""
        with torch.no_grad():
            b1 = 1.0 / math.sqrt(self.hidden_size)
            b2 = 1.0 / math.sqrt(self.intermediate_size)
            self.gate_up_proj.uniform_(-b1, b1)
            self.down_proj.uniform_(-b2, b2)

    def forward(self, x: Tensor, tokens_per_expert: Tensor, row_weight: Tensor | None = None) -> Tensor:
        """Apply the local experts to expert-contiguous rows.

        Args:
            x: ``[M, H]`` rows grouped by (local) expert, ``M >= tokens_per_expert.sum()`` (rows
                past the groups are not computed and their output is unspecified).
            tokens_per_expert: ``[E_local]`` int64 rows per local expert.
            row_weight: ``[M]`` optional routing weight per row, fused into the SwiGLU (by linearity,
                ``down(w * h) == w * down(h)``).

        Returns:
            ``[M, H]``.
        """
        w1 = local_tensor(self.gate_up_proj)
        w2 = local_tensor(self.down_proj)
        # Adapters (e.g. plait.peft's expert LoRA) registered in ``self.lora`` by parameter name add
        # their low-rank term to each grouped GEMM's output, on the same expert-contiguous rows.
        adapters = getattr(self, "lora", None)
        h = gmm(x, w1, tokens_per_expert, trans_w=True)
        if adapters is not None and "gate_up_proj" in adapters:
            h = adapters["gate_up_proj"](h, x, tokens_per_expert, gmm=gmm)
        a = swiglu_fused(h, row_weight)
        out = gmm(a, w2, tokens_per_expert, trans_w=True)
        if adapters is not None and "down_proj" in adapters:
            out = adapters["down_proj"](out, a, tokens_per_expert, gmm=gmm)
        return out


class SharedExpert(nn.Module):
    """A dense SwiGLU FFN every token goes through (Qwen2-MoE / DeepSeek shared experts)."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        """``down(silu(gate(x)) * up(x))``."""
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))
