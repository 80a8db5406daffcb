"""SwiGLU: ``silu(gate) * up``, optionally times a per-row weight (the MoE routing probability).

Two layouts: separate ``gate``/``up`` tensors, or one fused ``gate_up [..., 2I]`` tensor (gate half
first, the layout of a fused gate/up projection). Math is done in fp32 and the result is cast to the
input dtype. On CUDA (or under ``TRITON_INTERPRET=1``) a Triton kernel recomputes ``silu`` in the
backward instead of saving it, so the op saves only its inputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from plait.kernels._dispatch import use_triton

__all__ = ["swiglu", "swiglu_fused", "swiglu_reference"]


def swiglu_reference(
    gate: torch.Tensor, up: torch.Tensor, row_weight: torch.Tensor | None = None
) -> torch.Tensor:
    """Plain-PyTorch SwiGLU (fp32 math, output in ``gate.dtype``); the CPU path and test baseline."""
    y = F.silu(gate.float()) * up.float()
    if row_weight is not None:
        y = y * row_weight.float().unsqueeze(-1)
    return y.to(gate.dtype)


def _check(gate: torch.Tensor, up: torch.Tensor, row_weight: torch.Tensor | None) -> None:
    if gate.shape != up.shape:
        raise ValueError(
            f"swiglu: gate {tuple(gate.shape)} and up {tuple(up.shape)} must have the same shape"
        )
    if gate.dtype != up.dtype:
        raise ValueError(f"swiglu: gate dtype {gate.dtype} != up dtype {up.dtype}")
    if gate.dim() < 1:
        raise ValueError("swiglu: inputs need at least one dimension")
    if row_weight is not None and row_weight.shape != gate.shape[:-1]:
        raise ValueError(
            f"swiglu: row_weight shape {tuple(row_weight.shape)} must equal the leading dims "
            f"{tuple(gate.shape[:-1])} of gate"
        )


def swiglu(gate: torch.Tensor, up: torch.Tensor, row_weight: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(gate) * up (* row_weight[..., None])``.

    Args:
        gate: ``[..., I]``.
        up: same shape and dtype as ``gate``.
        row_weight: optional ``[...]`` per-row scale (e.g. the routing probability of each permuted
            token), fused into the kernel so the weighted output is written once.

    Returns:
        ``[..., I]`` in ``gate.dtype``.
    """
    _check(gate, up, row_weight)
    tensors = [gate, up] + ([row_weight] if row_weight is not None else [])
    if use_triton(*tensors):
        from plait.kernels._triton.swiglu import swiglu_triton

        return swiglu_triton(gate, up, row_weight, fused=False)
    return swiglu_reference(gate, up, row_weight)


def swiglu_fused(gate_up: torch.Tensor, row_weight: torch.Tensor | None = None) -> torch.Tensor:
    """SwiGLU on a fused ``[..., 2I]`` tensor whose first half is the gate, second half the up projection.

    Args:
        gate_up: ``[..., 2I]``.
        row_weight: optional ``[...]`` per-row scale.

    Returns:
        ``[..., I]`` in ``gate_up.dtype``; the backward returns a single ``[..., 2I]`` gradient.
    """
    if gate_up.dim() < 1 or gate_up.shape[-1] % 2:
        raise ValueError(f"swiglu_fused: last dim of gate_up {tuple(gate_up.shape)} must be even (2 * I)")
    gate, up = gate_up.chunk(2, dim=-1)
    _check(gate, up, row_weight)
    tensors = [gate_up] + ([row_weight] if row_weight is not None else [])
    if use_triton(*tensors):
        from plait.kernels._triton.swiglu import swiglu_triton

        return swiglu_triton(gate_up, None, row_weight, fused=True)
    return swiglu_reference(gate, up, row_weight)
