"""One-pass linear cross-entropy: the ``plait::linear_cross_entropy_fused`` custom ops, whose forward
computes the gradients of the summed loss too (package docstring)."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from plait.kernels._dispatch import use_triton
from plait.kernels._eager import eager_autograd
from plait.kernels.grad_direction import _returned, _weights_wanted
from plait.kernels.linear_cross_entropy.tiles import tile_grad_torch, tile_stats_torch

__all__ = ["lce_fused", "lce_fused_op", "one_pass_blocker", "one_pass_chunks"]


def one_pass_chunks(
    n_tokens: int, vocab: int, chunk_tokens: int | None, chunk_vocab: int | None
) -> tuple[int, int]:
    """Tokens per chunk and columns per row-kernel step of the one-pass path (explicit sizes win)."""
    # A [chunk, V] logits tile of at most 256M entries (512 MiB in bf16), in multiples of 128 tokens
    # and at least 128: few chunks, so few accumulations into dW (each reads and writes all of it);
    # the row kernel steps over a row's columns 8192 at a time.
    nc = chunk_tokens or min(n_tokens, max(128, (256 * 1024 * 1024) // max(vocab, 1) // 128 * 128))
    return max(1, nc), max(1, chunk_vocab or min(vocab, 8192))


def _row_loss_grad_torch(
    logits: torch.Tensor,
    local_t: torch.Tensor,
    loss: torch.Tensor,
    z_loss: float,
    softcap: float | None,
    _block: int,
) -> None:
    n = logits.shape[0]
    m = torch.full((n,), -math.inf, dtype=torch.float32, device=logits.device)
    s = torch.zeros(n, dtype=torch.float32, device=logits.device)
    tgt = torch.zeros(n, dtype=torch.float32, device=logits.device)
    tile_stats_torch(logits, local_t, m, s, tgt, softcap)
    lse = m + torch.log(s)
    valid = local_t >= 0
    loss.copy_(torch.where(valid, lse - tgt + z_loss * lse * lse, 0.0))
    # Gradient of the summed loss: d(loss)/d(lse) = 1 + 2 z lse on valid tokens, 0 elsewhere.
    g_t = valid.float()
    tile_grad_torch(logits, local_t, lse, g_t * (1.0 + 2.0 * z_loss * lse), g_t, softcap)


def _scale_torch(x: torch.Tensor, g: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    return x.mul_(g) if inplace else (x.float() * g).to(x.dtype)


def _one_pass_ops(triton: bool) -> tuple[Any, Any]:
    if triton:
        from plait.kernels._triton.linear_cross_entropy import row_loss_grad_triton, scale_triton

        return row_loss_grad_triton, scale_triton
    return _row_loss_grad_torch, _scale_torch


def _fused_impl(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int,
    z_loss: float,
    softcap: float | None,
    nc: int,
    vb: int,
    need_dx: bool,
    need_dw: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(loss_sum fp32 scalar, dx, dw)``: the summed loss and its gradients (each empty when not needed).

    One pass over token chunks with the whole vocabulary: ``logits = x_c @ W.T`` (``[chunk, V]``),
    one kernel for its per-row loss and ``dlogits`` in place of the logits (two sweeps of each row,
    ``vb`` columns a step), then ``dx_c = dlogits @ W`` and ``dw (+)= dlogits^T @ x_c``. ``dw``
    accumulates in the weight dtype (``addmm_``, as the two-pass backward does): cuBLAS sums each
    chunk's product in fp32 and rounds once per chunk. An fp32 accumulator would need
    ``addmm(..., out_dtype=float32)``, which has no CPU kernel, plus ``4 V H`` bytes.
    """
    n = hidden.shape[0]
    row_loss_grad, _ = _one_pass_ops(use_triton(hidden, weight))
    local_all = torch.where(targets != ignore_index, targets, -1)
    loss = torch.empty(n, dtype=torch.float32, device=hidden.device)
    dx = hidden.new_empty(hidden.shape if need_dx else (0,))
    dw = weight.new_empty(weight.shape if need_dw else (0,))
    if need_dw and n == 0:
        dw.zero_()
    for a in range(0, n, nc):
        xc = hidden[a : a + nc]
        logits = xc @ weight.T
        row_loss_grad(logits, local_all[a : a + nc], loss[a : a + nc], z_loss, softcap, vb)
        if need_dx:
            torch.mm(logits, weight, out=dx[a : a + nc])
        if need_dw:
            if a == 0:
                torch.mm(logits.T, xc, out=dw)
            else:
                dw.addmm_(logits.T, xc)
        del logits  # before the next chunk's tile is allocated: one tile alive at a time
    return loss.sum(), dx, dw


lce_fused_op = torch.library.custom_op(
    "plait::linear_cross_entropy_fused",
    mutates_args=(),
    schema="(Tensor hidden, Tensor weight, Tensor targets, int ignore_index, float z_loss, float? softcap, "
    "int chunk_tokens, int chunk_vocab, bool need_dx, bool need_dw) -> (Tensor, Tensor, Tensor)",
)(_fused_impl)


@lce_fused_op.register_fake
def _(hidden: torch.Tensor, weight: torch.Tensor, *args: Any) -> Any:
    need_dx, need_dw = args[-2], args[-1]
    return (
        hidden.new_empty((), dtype=torch.float32),
        hidden.new_empty(hidden.shape if need_dx else (0,)),
        weight.new_empty(weight.shape if need_dw else (0,)),
    )


@torch.library.custom_op(
    "plait::linear_cross_entropy_fused_backward",
    mutates_args=(),
    schema="(Tensor dloss, Tensor dx, Tensor dw, bool need_dx, bool need_dw) -> (Tensor, Tensor)",
)
def _lce_fused_backward_op(
    dloss: torch.Tensor, dx: torch.Tensor, dw: torch.Tensor, need_dx: bool, need_dw: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The stored gradients times ``dloss`` (in fp32, cast back); empty when not needed, ``dw`` zero
    when the grad-direction switch is off for weights (read here, when the op runs)."""
    g = dloss.float()
    _, scale = _one_pass_ops(use_triton(dx, dw))
    gx = scale(dx, g) if need_dx else dx.new_empty(0)
    want_dw = _weights_wanted(need_dw)
    gw = scale(dw, g) if want_dw else (torch.zeros_like(dw) if need_dw else dw.new_empty(0))
    return gx, gw


@_lce_fused_backward_op.register_fake
def _(dloss: Any, dx: torch.Tensor, dw: torch.Tensor, need_dx: bool, need_dw: bool) -> Any:
    return dx.new_empty(dx.shape if need_dx else (0,)), dw.new_empty(dw.shape if need_dw else (0,))


def _setup_outputs(ctx: Any, inputs: tuple[Any, ...], dx: torch.Tensor, dw: torch.Tensor) -> None:
    """What both backwards read: the gradients the forward computed; dx and dw are not differentiable."""
    ctx.computed = inputs[-2:]  # need_dx, need_dw
    ctx.mark_non_differentiable(dx, dw)
    ctx.set_materialize_grads(False)


def _to_return(ctx: Any) -> tuple[bool, bool]:
    """Which of (dhidden, dweight) this backward returns (computed, needed, and asked for by the grad direction)."""
    has_dx, has_dw = ctx.computed
    return _returned(ctx.needs_input_grad[0] and has_dx, ctx.needs_input_grad[1] and has_dw)


def _fused_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
    _loss, dx, dw = output
    ctx.save_for_backward(dx, dw)
    _setup_outputs(ctx, inputs, dx, dw)


def _fused_backward(ctx: Any, dloss: torch.Tensor | None, _ddx: Any, _ddw: Any) -> tuple[Any, ...]:
    dx, dw = ctx.saved_tensors
    need_dx, need_dw = _to_return(ctx)
    if dloss is None or not (need_dx or need_dw):
        return (None,) * 10
    gx, gw = _lce_fused_backward_op(dloss, dx, dw, need_dx, need_dw)
    return (gx if need_dx else None), (gw if need_dw else None), *(None,) * 8


lce_fused_op.register_autograd(_fused_backward, setup_context=_fused_setup)


def _eager_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
    _loss, dx, dw = output
    ctx.stored = [dx, dw]  # not saved_tensors: scaled in place, then dropped when returned
    _setup_outputs(ctx, inputs, dx, dw)


def _eager_backward(ctx: Any, dloss: torch.Tensor | None, _ddx: Any, _ddw: Any) -> tuple[Any, ...]:
    """Eager calls' backward: scales the stored gradients in place and hands them over (the custom op's
    backward returns scaled copies: one more ``dW``-sized buffer at the peak, and autograd copies a
    gradient it cannot take over).

    Each stored gradient is returned once: the inputs and weights passes of a split backward each
    take their own; asking for one again (a second backward with ``retain_graph``) raises.
    """
    need = _to_return(ctx)
    if dloss is None or not any(need):
        return (None,) * 10
    wanted = (need[0], _weights_wanted(need[1]))
    grads: list[Any] = [None, None]
    for i, name in enumerate(("hidden", "weight")):
        if not need[i]:
            continue
        t = ctx.stored[i]
        if t is None:
            raise RuntimeError(
                f"linear_cross_entropy: the {name} gradient computed in the forward (grad_in_forward) was "
                "already returned by an earlier backward; pass grad_in_forward=False to backward twice"
            )
        if wanted[i]:
            ctx.stored[i] = None
            # the Triton kernel: mul_ with a 0-d fp32 CUDA tensor runs a casting kernel at ~half bandwidth
            grads[i] = _one_pass_ops(use_triton(t))[1](t, dloss.float(), inplace=True)
        else:
            grads[i] = torch.zeros_like(t)
    return grads[0], grads[1], *(None,) * 8


_one_pass_eager = eager_autograd(_fused_impl, _eager_setup, _eager_backward, name="OnePassEager")


def lce_fused(*args: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`lce_fused_op` (same arguments): the custom op while compiling, its eager autograd function
    (whose backward hands the stored gradients over in place) otherwise."""
    if torch.compiler.is_compiling():
        return lce_fused_op(*args)
    return _one_pass_eager(*args)  # type: ignore[no-any-return]


def one_pass_blocker(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    reduction: str,
    return_lse: bool,
    process_group: dist.ProcessGroup | None,
    backend: str,
) -> str | None:
    """Why the one-pass mode does not apply (``None`` when it does)."""
    if backend == "cce":
        return "backend='cce'"
    if reduction == "none":
        return "reduction='none' (the loss must be reduced to a scalar)"
    if return_lse:
        return "return_lse=True"
    if process_group is not None:
        return "a process_group is given (vocabulary-parallel)"
    if not torch.is_grad_enabled():
        return "grad mode is disabled"
    if not (hidden.requires_grad or weight.requires_grad):
        return "neither hidden nor weight requires grad"
    return None
