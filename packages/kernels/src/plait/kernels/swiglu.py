"""SwiGLU: ``silu(gate) * up``, optionally times a per-row weight (the MoE routing probability).

Two layouts: separate ``gate``/``up`` tensors, or one fused ``gate_up [..., 2I]`` tensor (gate half
first, the layout of a fused gate/up projection). Math is done in fp32 and the result is cast to the
input dtype. On CUDA (or under ``TRITON_INTERPRET=1``) a Triton kernel recomputes ``silu`` in the
backward instead of saving it, so the op saves only its inputs. The torch custom op is ``plait::swiglu``;
eager calls run its implementation and autograd formula without the dispatcher
(:mod:`plait.kernels._eager`); inside ``torch.compile`` the function traces its PyTorch formulation,
which Inductor fuses.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from plait.kernels._dispatch import use_triton
from plait.kernels._eager import eager_autograd

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


def _forward_torch(a: torch.Tensor, b: torch.Tensor | None, w: torch.Tensor | None) -> torch.Tensor:
    gate, up = a.chunk(2, dim=-1) if b is None else (a, b)
    return swiglu_reference(gate, up, w).contiguous()


def _backward_torch(
    dy: torch.Tensor, a: torch.Tensor, b: torch.Tensor | None, w: torch.Tensor | None, need_dw: bool
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    gate, up = a.chunk(2, dim=-1) if b is None else (a, b)
    g, u = gate.float(), up.float()
    s = torch.sigmoid(g)
    silu = g * s
    dyf = dy.float()
    dw = (dyf * silu * u).sum(-1).to(w.dtype) if need_dw and w is not None else None
    if w is not None:
        dyf = dyf * w.float().unsqueeze(-1)
    dg = dyf * u * s * (1.0 + g * (1.0 - s))
    du = dyf * silu
    if b is None:
        return torch.cat([dg, du], dim=-1).to(a.dtype), None, dw
    return dg.to(a.dtype).contiguous(), du.to(b.dtype).contiguous(), dw


def _forward_impl(a: torch.Tensor, b: torch.Tensor | None, row_weight: torch.Tensor | None) -> torch.Tensor:
    tensors = [t for t in (a, b, row_weight) if t is not None]
    if use_triton(*tensors):
        from plait.kernels._triton.swiglu import swiglu_forward

        return swiglu_forward(a, b, row_weight)
    return _forward_torch(a, b, row_weight)


@torch.library.custom_op(
    "plait::swiglu", mutates_args=(), schema="(Tensor a, Tensor? b, Tensor? row_weight) -> Tensor"
)
def _swiglu_op(a: torch.Tensor, b: torch.Tensor | None, row_weight: torch.Tensor | None) -> torch.Tensor:
    """``silu(gate) * up (* row_weight)``; ``b is None`` means ``a`` is the fused ``[..., 2I]`` tensor."""
    return _forward_impl(a, b, row_weight)


@_swiglu_op.register_fake
def _(a: torch.Tensor, b: Any, row_weight: Any) -> torch.Tensor:
    n = a.shape[-1] if b is not None else a.shape[-1] // 2
    return a.new_empty((*a.shape[:-1], n))


def _backward_impl(
    dy: torch.Tensor, a: torch.Tensor, b: torch.Tensor | None, row_weight: torch.Tensor | None, need_dw: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    tensors = [t for t in (dy, a, b, row_weight) if t is not None]
    if use_triton(*tensors):
        from plait.kernels._triton.swiglu import swiglu_backward

        da, db, dw = swiglu_backward(dy, a, b, row_weight, need_dw)
    else:
        da, db, dw = _backward_torch(dy, a, b, row_weight, need_dw)
    return da, (db if db is not None else a.new_empty(0)), (dw if dw is not None else a.new_empty(0))


@torch.library.custom_op(
    "plait::swiglu_backward",
    mutates_args=(),
    schema="(Tensor dy, Tensor a, Tensor? b, Tensor? row_weight, bool need_dw) -> (Tensor, Tensor, Tensor)",
)
def _swiglu_backward_op(
    dy: torch.Tensor, a: torch.Tensor, b: torch.Tensor | None, row_weight: torch.Tensor | None, need_dw: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(da, db, d_row_weight)``; ``db`` empty when fused, ``d_row_weight`` empty when not needed."""
    return _backward_impl(dy, a, b, row_weight, need_dw)


@_swiglu_backward_op.register_fake
def _(dy: Any, a: torch.Tensor, b: Any, row_weight: Any, need_dw: bool) -> Any:
    db = b.new_empty(b.shape) if b is not None else a.new_empty(0)
    dw = row_weight.new_empty(row_weight.shape) if need_dw and row_weight is not None else a.new_empty(0)
    return a.new_empty(a.shape), db, dw


def _setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    a, b, w = inputs
    ctx.save_for_backward(a, b, w)


def _backward(
    backward_op: Callable[..., tuple[torch.Tensor, ...]], ctx: Any, dy: torch.Tensor
) -> tuple[Any, ...]:
    a, b, w = ctx.saved_tensors
    need_dw = w is not None and ctx.needs_input_grad[2]
    da, db, dw = backward_op(dy, a, b, w, need_dw)
    return da, (db if b is not None else None), (dw if need_dw else None)


_swiglu_op.register_autograd(functools.partial(_backward, _swiglu_backward_op), setup_context=_setup)
# Eager calls: the same implementation and formula without the dispatcher (see plait.kernels._eager).
_swiglu_eager = eager_autograd(_forward_impl, _setup, functools.partial(_backward, _backward_impl))


def swiglu(gate: torch.Tensor, up: torch.Tensor, row_weight: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(gate) * up (* row_weight[..., None])`` (torch custom op ``plait::swiglu``; eager calls skip
    its dispatcher, see :mod:`plait.kernels._eager`).

    Args:
        gate: ``[..., I]``.
        up: same shape and dtype as ``gate``.
        row_weight: optional ``[...]`` per-row scale (e.g. the routing probability of each permuted
            token), fused into the kernel so the weighted output is written once.

    Returns:
        ``[..., I]`` in ``gate.dtype``.
    """
    _check(gate, up, row_weight)
    if torch.compiler.is_compiling():  # Inductor fuses the PyTorch formulation (see rms_norm)
        return swiglu_reference(gate, up, row_weight)
    return _swiglu_eager(gate, up, row_weight)


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
    if torch.compiler.is_compiling():
        return swiglu_reference(gate, up, row_weight)
    return _swiglu_eager(gate_up, None, row_weight)
