"""SwiGLU: ``silu(gate) * up``, optionally times a per-row weight (the MoE routing probability).

Two layouts: separate ``gate``/``up`` tensors, or one fused ``gate_up [..., 2I]`` tensor (gate half
first, the layout of a fused gate/up projection). Math is done in fp32 and the result is cast to the
input dtype. On CUDA (or under ``TRITON_INTERPRET=1``) a Triton kernel recomputes ``silu`` in the
backward instead of saving it, so the op saves only its inputs. The torch op is ``plait::swiglu``
(a ``triton_op``); eager calls run its implementation and autograd formula without the dispatcher
(:mod:`plait.kernels._eager`); inside ``torch.compile`` the function traces its PyTorch formulation,
which Inductor fuses, except with ``num_rows`` (:func:`swiglu_fused`), where the graph launches the
op's Triton kernels, which skip the rows past it.
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


def _forward_impl(
    a: torch.Tensor, b: torch.Tensor | None, row_weight: torch.Tensor | None, num_rows: torch.Tensor | None
) -> torch.Tensor:
    tensors = [t for t in (a, b, row_weight, num_rows) if t is not None]
    if use_triton(*tensors):
        from plait.kernels._triton.swiglu import swiglu_forward

        return swiglu_forward(a, b, row_weight, num_rows)
    return _forward_torch(a, b, row_weight)


@torch.library.triton_op(
    "plait::swiglu",
    mutates_args=(),
    schema="(Tensor a, Tensor? b, Tensor? row_weight, Tensor? num_rows=None) -> Tensor",
)
def _swiglu_op(
    a: torch.Tensor,
    b: torch.Tensor | None,
    row_weight: torch.Tensor | None,
    num_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """``silu(gate) * up (* row_weight)``; ``b is None`` means ``a`` is the fused ``[..., 2I]`` tensor;
    rows at or past ``num_rows`` are not computed on the Triton path."""
    return _forward_impl(a, b, row_weight, num_rows)


def _backward_impl(
    dy: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor | None,
    row_weight: torch.Tensor | None,
    need_dw: bool,
    num_rows: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    tensors = [t for t in (dy, a, b, row_weight, num_rows) if t is not None]
    if use_triton(*tensors):
        from plait.kernels._triton.swiglu import swiglu_backward

        da, db, dw = swiglu_backward(dy, a, b, row_weight, need_dw, num_rows)
    else:
        da, db, dw = _backward_torch(dy, a, b, row_weight, need_dw)
    return da, (db if db is not None else a.new_empty(0)), (dw if dw is not None else a.new_empty(0))


@torch.library.triton_op(
    "plait::swiglu_backward",
    mutates_args=(),
    schema="(Tensor dy, Tensor a, Tensor? b, Tensor? row_weight, bool need_dw, Tensor? num_rows=None) "
    "-> (Tensor, Tensor, Tensor)",
)
def _swiglu_backward_op(
    dy: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor | None,
    row_weight: torch.Tensor | None,
    need_dw: bool,
    num_rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(da, db, d_row_weight)``; ``db`` empty when fused, ``d_row_weight`` empty when not needed."""
    return _backward_impl(dy, a, b, row_weight, need_dw, num_rows)


def _setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    a, b, w, n = inputs
    ctx.save_for_backward(a, b, w, n)


def _backward(
    backward_op: Callable[..., tuple[torch.Tensor, ...]], ctx: Any, dy: torch.Tensor
) -> tuple[Any, ...]:
    a, b, w, n = ctx.saved_tensors
    need_dw = w is not None and ctx.needs_input_grad[2]
    da, db, dw = backward_op(dy, a, b, w, need_dw, n)
    return da, (db if b is not None else None), (dw if need_dw else None), None


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
    return _swiglu_eager(gate, up, row_weight, None)


def swiglu_fused(
    gate_up: torch.Tensor, row_weight: torch.Tensor | None = None, num_rows: torch.Tensor | None = None
) -> torch.Tensor:
    """SwiGLU on a fused ``[..., 2I]`` tensor whose first half is the gate, second half the up projection.

    Args:
        gate_up: ``[..., 2I]``.
        row_weight: optional ``[...]`` per-row scale.
        num_rows: optional one-element integer tensor on ``gate_up``'s device: only the first
            ``num_rows`` rows (of the flattened leading dims) are computed, forward and backward; the
            other rows' outputs and gradients are unspecified. For a buffer sized by a static bound
            whose used part is known only on the device (the MoE experts' rows past their groups):
            the Triton path neither reads nor writes those rows, and inside ``torch.compile`` the
            kernels run from the graph (a ``triton_op``) instead of Inductor's fusion of the formula.
            The PyTorch path computes every row.

    Returns:
        ``[..., I]`` in ``gate_up.dtype``; the backward returns a single ``[..., 2I]`` gradient.

    Raises:
        ValueError: an odd last dim, a ``row_weight`` of the wrong shape, or a ``num_rows`` that is not
            a one-element integer tensor.
    """
    if gate_up.dim() < 1 or gate_up.shape[-1] % 2:
        raise ValueError(f"swiglu_fused: last dim of gate_up {tuple(gate_up.shape)} must be even (2 * I)")
    gate, up = gate_up.chunk(2, dim=-1)
    _check(gate, up, row_weight)
    if num_rows is not None and (
        num_rows.numel() != 1 or num_rows.dtype.is_floating_point or num_rows.dtype == torch.bool
    ):
        raise ValueError(
            f"swiglu_fused: num_rows must be a one-element integer tensor, got {num_rows.dtype} "
            f"{tuple(num_rows.shape)}"
        )
    if torch.compiler.is_compiling():
        if num_rows is None:
            return swiglu_reference(gate, up, row_weight)
        return torch.ops.plait.swiglu(gate_up, None, row_weight, num_rows)
    return _swiglu_eager(gate_up, None, row_weight, num_rows)
