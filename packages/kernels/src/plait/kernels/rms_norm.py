"""RMSNorm with fp32 statistics, optional weight offset and optional fused residual add.

``y = h / sqrt(mean(h^2) + eps) * (weight + offset)`` with ``h = x`` or ``h = x + residual``.
``offset=1.0`` gives the zero-centred ("1 + weight") parameterisation. With a residual the op returns
``(y, h)`` so the caller can carry ``h`` as the next residual stream without another add kernel.
The weight gradient respects :func:`plait.kernels.grad_direction`.
"""

from __future__ import annotations

import torch
from plait.kernels._dispatch import use_triton
from plait.kernels.grad_direction import _wants_inputs, _wants_weights

__all__ = ["rms_norm", "rms_norm_reference"]


def rms_norm_reference(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float = 1e-6,
    offset: float = 0.0,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Plain-PyTorch RMSNorm (autograd-differentiable; ignores the grad-direction switch)."""
    h = x if residual is None else (x.float() + residual.float()).to(x.dtype)
    hf = h.float()
    y = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * (weight.float() + offset)
    y = y.to(x.dtype)
    return y if residual is None else (y, h)


class _RMSNormTorch(torch.autograd.Function):
    """PyTorch fallback with an explicit backward so the weight grad can be switched off."""

    @staticmethod
    def forward(ctx, h, weight, eps, offset):  # type: ignore[override]
        hf = h.float()
        rstd = torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
        xhat = hf * rstd
        y = xhat * (weight.float() + offset) if weight is not None else xhat
        ctx.save_for_backward(h, weight, rstd)
        ctx.offset = offset
        return y.to(h.dtype)

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        h, weight, rstd = ctx.saved_tensors
        xhat = h.float() * rstd
        dyf = dy.float()
        dh = dw = None
        if ctx.needs_input_grad[0] and _wants_inputs():
            g = dyf * (weight.float() + ctx.offset) if weight is not None else dyf
            dh = (rstd * (g - xhat * (g * xhat).mean(-1, keepdim=True))).to(h.dtype)
        if weight is not None and ctx.needs_input_grad[1] and _wants_weights():
            dw = (dyf * xhat).reshape(-1, h.shape[-1]).sum(0).to(weight.dtype)
        return dh, dw, None, None


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float = 1e-6,
    offset: float = 0.0,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dimension.

    Args:
        x: ``[..., H]``.
        weight: ``[H]`` scale (or ``None`` for no affine).
        eps: added to the mean square before the reciprocal square root.
        offset: added to ``weight`` (``1.0`` for zero-centred weights, as in Gemma/Qwen3-Next).
        residual: optional ``[..., H]``; when given, ``h = x + residual`` is normalised and
            ``(y, h)`` is returned.

    Returns:
        ``y`` in ``x.dtype``, or ``(y, h)`` with a residual.
    """
    if weight is not None and weight.shape != x.shape[-1:]:
        raise ValueError(f"rms_norm: weight shape {tuple(weight.shape)} must be ({x.shape[-1]},)")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(
            f"rms_norm: residual {tuple(residual.shape)}/{residual.dtype} must match x {tuple(x.shape)}/{x.dtype}"
        )
    tensors = [x] + [t for t in (weight, residual) if t is not None]
    if use_triton(*tensors):
        from plait.kernels._triton.rms_norm import rms_norm_triton

        return rms_norm_triton(x, weight, eps, offset, residual)
    if residual is None:
        return _RMSNormTorch.apply(x, weight, eps, offset)
    h = (x.float() + residual.float()).to(x.dtype)
    return _RMSNormTorch.apply(h, weight, eps, offset), h
