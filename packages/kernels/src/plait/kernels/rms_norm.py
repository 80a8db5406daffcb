"""RMSNorm with fp32 statistics, optional weight offset and optional fused residual add.

``y = h / sqrt(mean(h^2) + eps) * (weight + offset)`` with ``h = x`` or ``h = x + residual``.
``offset=1.0`` gives the zero-centred ("1 + weight") parameterisation. With a residual the op returns
``(y, h)`` so the caller can carry ``h`` as the next residual stream without another add kernel.
The weight gradient respects :func:`plait.kernels.grad_direction`.

The torch custom ops are ``plait::rms_norm`` (backward ``plait::rms_norm_backward``). Eager calls run
their implementation and autograd formula without the dispatcher (:mod:`plait.kernels._eager`);
inside ``torch.compile`` the function traces its PyTorch formulation, which Inductor fuses.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from plait.kernels._dispatch import use_triton
from plait.kernels._eager import eager_autograd
from plait.kernels.grad_direction import _returned, _weights_wanted

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
        # No "+ 0.0": in fp32 inside a checkpointed region compiled by inductor, that weight-only add
        # made AOTAutograd's partitioner fail ("Node ... was invalid, but is output", torch 2.15).
        y = y * (weight.float() + offset if offset else weight.float())
    y = y.to(x.dtype)
    return y if residual is None else (y, h)


def _forward_torch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None, eps: float, offset: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    h = x if residual is None else (x.float() + residual.float()).to(x.dtype)
    hf = h.float()
    rstd = torch.rsqrt(hf.pow(2).mean(-1) + eps)
    y = hf * rstd.unsqueeze(-1)
    if weight is not None:
        y = y * (weight.float() + offset)
    # Contiguous like the fake implementation (and the Triton path), whatever x's strides.
    h_out = h.contiguous() if residual is not None else x.new_empty(0)
    return y.to(x.dtype).contiguous(), h_out, rstd.contiguous()


def _backward_torch(
    dy: torch.Tensor,
    dh: torch.Tensor | None,
    h: torch.Tensor,
    weight: torch.Tensor | None,
    rstd: torch.Tensor,
    offset: float,
    need_dx: bool,
    need_dw: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    rstd = rstd.unsqueeze(-1)
    xhat = h.float() * rstd
    dyf = dy.float()
    dx = dw = None
    if need_dx:
        g = dyf * (weight.float() + offset) if weight is not None else dyf
        dxf = rstd * (g - xhat * (g * xhat).mean(-1, keepdim=True))
        if dh is not None:
            dxf = dxf + dh.float()
        dx = dxf.to(h.dtype).contiguous()
    if need_dw and weight is not None:
        dw = (dyf * xhat).reshape(-1, h.shape[-1]).sum(0).to(weight.dtype)
    return dx, dw


def _forward_impl(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None, eps: float, offset: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    tensors = [x] + [t for t in (weight, residual) if t is not None]
    if use_triton(*tensors):
        from plait.kernels._triton.rms_norm import rms_norm_forward

        return rms_norm_forward(x, residual, weight, eps, offset)
    return _forward_torch(x, residual, weight, eps, offset)


@torch.library.custom_op(
    "plait::rms_norm",
    mutates_args=(),
    schema="(Tensor x, Tensor? residual, Tensor? weight, float eps, float offset) -> (Tensor, Tensor, Tensor)",
)
def _rms_norm_op(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None, eps: float, offset: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(y, h, rstd)``: ``h = x + residual`` (empty without a residual), ``rstd`` fp32 ``x.shape[:-1]``."""
    return _forward_impl(x, residual, weight, eps, offset)


@_rms_norm_op.register_fake
def _(x: torch.Tensor, residual: Any, weight: Any, eps: float, offset: float) -> Any:
    h = x.new_empty(x.shape) if residual is not None else x.new_empty(0)
    return x.new_empty(x.shape), h, x.new_empty(x.shape[:-1], dtype=torch.float32)


def _backward_impl(
    dy: torch.Tensor,
    dh: torch.Tensor | None,
    h: torch.Tensor,
    weight: torch.Tensor | None,
    rstd: torch.Tensor,
    offset: float,
    need_dx: bool,
    need_dw: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    want_dw = _weights_wanted(need_dw and weight is not None)
    dx = dw = None
    if need_dx or want_dw:
        tensors = [dy, h] + [t for t in (weight, dh) if t is not None]
        if use_triton(*tensors):
            from plait.kernels._triton.rms_norm import rms_norm_backward

            dx, dw = rms_norm_backward(dy, dh, h, weight, rstd, offset, need_dx, want_dw)
        else:
            dx, dw = _backward_torch(dy, dh, h, weight, rstd, offset, need_dx, want_dw)
    if dx is None:
        dx = h.new_empty(0)
    if dw is None:
        dw = torch.zeros_like(weight) if need_dw and weight is not None else h.new_empty(0)
    return dx, dw


@torch.library.custom_op(
    "plait::rms_norm_backward",
    mutates_args=(),
    schema="(Tensor dy, Tensor? dh, Tensor h, Tensor? weight, Tensor rstd, float offset, bool need_dx, "
    "bool need_dw) -> (Tensor, Tensor)",
)
def _rms_norm_backward_op(
    dy: torch.Tensor,
    dh: torch.Tensor | None,
    h: torch.Tensor,
    weight: torch.Tensor | None,
    rstd: torch.Tensor,
    offset: float,
    need_dx: bool,
    need_dw: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dx, dw)``; each is empty when not needed; ``dw`` is zero when the grad-direction switch is off for weights."""
    return _backward_impl(dy, dh, h, weight, rstd, offset, need_dx, need_dw)


@_rms_norm_backward_op.register_fake
def _(
    dy: Any, dh: Any, h: torch.Tensor, weight: Any, rstd: Any, offset: float, need_dx: bool, need_dw: bool
) -> Any:
    dx = h.new_empty(h.shape) if need_dx else h.new_empty(0)
    dw = weight.new_empty(weight.shape) if need_dw and weight is not None else h.new_empty(0)
    return dx, dw


def _setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
    x, residual, weight, _eps, offset = inputs
    _y, h, rstd = output
    ctx.has_res = residual is not None
    ctx.save_for_backward(h if ctx.has_res else x, weight, rstd)
    ctx.offset = offset
    ctx.set_materialize_grads(False)


def _backward(
    backward_op: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    ctx: Any,
    dy: torch.Tensor | None,
    dh: torch.Tensor | None,
    _drstd: Any,
) -> tuple[Any, ...]:
    h, weight, rstd = ctx.saved_tensors
    need_x, need_r, need_w = ctx.needs_input_grad[:3]
    need_dx, need_dw = _returned(need_x or need_r, weight is not None and need_w)
    if not (need_dx or need_dw):
        return None, None, None, None, None
    if dy is None:
        dy = torch.zeros_like(h)
    dx, dw = backward_op(dy, dh if ctx.has_res else None, h, weight, rstd, ctx.offset, need_dx, need_dw)
    dx_out = dx if need_dx else None
    return (
        dx_out if need_x else None,
        dx_out if need_r else None,
        dw if need_dw else None,
        None,
        None,
    )


_rms_norm_op.register_autograd(functools.partial(_backward, _rms_norm_backward_op), setup_context=_setup)
_rms_norm_eager = eager_autograd(_forward_impl, _setup, functools.partial(_backward, _backward_impl))


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
    if torch.compiler.is_compiling():
        # Traced as plain PyTorch, Inductor fuses the norm with its neighbours and the compiled graph
        # makes no per-call custom-op dispatch (~150 us of host time each on an H100 host); eager
        # runs the Triton kernel.
        return rms_norm_reference(x, weight, eps, offset, residual)
    y, h, _rstd = _rms_norm_eager(x, residual, weight, float(eps), float(offset))
    return y if residual is None else (y, h)
