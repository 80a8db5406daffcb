"""Two-pass linear cross-entropy: the ``plait::linear_cross_entropy`` forward and backward custom ops.

The forward folds each ``[chunk, block]`` logit tile into per-token statistics; the backward
recomputes each tile into ``dlogits`` and feeds the two gradient matmuls (package docstring).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from plait.kernels._dispatch import use_triton
from plait.kernels.grad_direction import _returned, _weights_wanted
from plait.kernels.linear_cross_entropy.tiles import tile_ops
from plait.kernels.linear_cross_entropy.vocab_parallel import process_group_by_name, vocab_offset

__all__ = ["lce_op", "two_pass_chunks"]


def two_pass_chunks(
    n_tokens: int, hidden: int, vocab: int, chunk_tokens: int | None, chunk_vocab: int | None
) -> tuple[int, int]:
    """Tokens per chunk and vocabulary entries per tile of the two-pass path (explicit sizes win)."""
    # Defaults keep the fp32 [chunk, H] accumulator at ~32 MiB and one [chunk, block] tile (input dtype)
    # at up to 64M entries, with blocks of 4k-16k vocabulary entries: large enough that the matmuls
    # run at full rate and that few tiles (each a handful of kernel launches) cover the vocabulary.
    nc = chunk_tokens or min(n_tokens, max(256, (8 * 1024 * 1024) // max(hidden, 1)))
    vb = chunk_vocab or min(vocab, max(4096, min(16384, (64 * 1024 * 1024) // max(nc, 1))))
    return max(1, nc), max(1, vb)


@torch.library.custom_op(
    "plait::linear_cross_entropy",
    mutates_args=(),
    schema="(Tensor hidden, Tensor weight, Tensor targets, int ignore_index, float z_loss, float? softcap, "
    "str? group_name, int chunk_tokens, int chunk_vocab) -> (Tensor, Tensor, Tensor)",
)
def lce_op(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int,
    z_loss: float,
    softcap: float | None,
    group_name: str | None,
    nc: int,
    vb: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(loss [N] fp32, lse [N] fp32, local_targets [N] int64)``: targets minus this shard's first id."""
    n, v = hidden.shape[0], weight.shape[0]
    group = process_group_by_name(group_name)
    stats, _ = tile_ops(use_triton(hidden, weight))
    v0 = vocab_offset(v, group, hidden.device)
    valid = targets != ignore_index
    local_all = torch.where(valid, targets - v0, -1)
    m = torch.full((n,), -math.inf, dtype=torch.float32, device=hidden.device)
    s = torch.zeros(n, dtype=torch.float32, device=hidden.device)
    tgt = torch.zeros(n, dtype=torch.float32, device=hidden.device)
    for a in range(0, n, nc):
        xc = hidden[a : a + nc]
        for b in range(0, v, vb):
            logits = xc @ weight[b : b + vb].T
            stats(logits, local_all[a : a + nc] - b, m[a : a + nc], s[a : a + nc], tgt[a : a + nc], softcap)
            del logits  # one tile alive at a time
    if group is None:
        lse = m + torch.log(s)
    else:
        gm = m.clone()
        dist.all_reduce(gm, op=dist.ReduceOp.MAX, group=group)
        gm = torch.where(torch.isfinite(gm), gm, 0.0)
        s = s * torch.exp(m - gm)
        dist.all_reduce(s, group=group)
        dist.all_reduce(tgt, group=group)
        lse = gm + torch.log(s)
    loss = torch.where(valid, lse - tgt + z_loss * lse * lse, 0.0)
    return loss, lse, local_all


@lce_op.register_fake
def _(hidden: torch.Tensor, weight: Any, targets: torch.Tensor, *args: Any) -> Any:
    n = hidden.shape[0]
    f32 = hidden.new_empty(n, dtype=torch.float32)
    return f32, hidden.new_empty(n, dtype=torch.float32), targets.new_empty(n, dtype=torch.int64)


@torch.library.custom_op(
    "plait::linear_cross_entropy_backward",
    mutates_args=(),
    schema="(Tensor? dloss, Tensor? dlse, Tensor hidden, Tensor weight, Tensor local_targets, Tensor valid, "
    "Tensor lse, float z_loss, float? softcap, str? group_name, int chunk_tokens, int chunk_vocab, bool need_dx, "
    "bool need_dw) -> (Tensor, Tensor)",
)
def _lce_backward_op(
    dloss: torch.Tensor | None,
    dlse: torch.Tensor | None,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    local_all: torch.Tensor,
    valid: torch.Tensor,
    lse: torch.Tensor,
    z_loss: float,
    softcap: float | None,
    group_name: str | None,
    nc: int,
    vb: int,
    need_dx: bool,
    need_dw: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dx, dw)``; each is empty when not needed; ``dw`` is zero when the grad-direction switch is off for weights."""
    want_dw = _weights_wanted(need_dw)
    dx = hidden.new_empty(hidden.shape) if need_dx else None
    dw = weight.new_empty(weight.shape) if want_dw else None
    if need_dx or want_dw:
        _, grad = tile_ops(use_triton(hidden, weight))
        n, v = hidden.shape[0], weight.shape[0]
        g_t = torch.where(valid, dloss.float(), 0.0) if dloss is not None else torch.zeros_like(lse)
        # d(loss)/d(lse) = 1 + 2 z lse on valid tokens, plus the caller's direct gradient on lse.
        g_p = g_t * (1.0 + 2.0 * z_loss * lse)
        if dlse is not None:
            g_p = g_p + dlse.float()
        for a in range(0, n, nc):
            xc = hidden[a : a + nc]
            acc = torch.zeros(xc.shape, dtype=torch.float32, device=hidden.device) if dx is not None else None
            for b in range(0, v, vb):
                wb = weight[b : b + vb]
                logits = xc @ wb.T
                d = grad(
                    logits,
                    local_all[a : a + nc] - b,
                    lse[a : a + nc],
                    g_p[a : a + nc],
                    g_t[a : a + nc],
                    softcap,
                )
                if acc is not None:
                    acc += d @ wb
                if dw is not None:
                    if a == 0:
                        torch.mm(d.T, xc, out=dw[b : b + vb])
                    else:
                        dw[b : b + vb].addmm_(d.T, xc)
                del logits, d  # one tile alive at a time
            if dx is not None and acc is not None:
                dx[a : a + nc] = acc
        group = process_group_by_name(group_name)
        if dx is not None and group is not None:
            dist.all_reduce(dx, group=group)
        if dw is not None and n == 0:
            dw.zero_()
    if dx is None:
        dx = hidden.new_empty(0)
    if dw is None:
        dw = torch.zeros_like(weight) if need_dw else weight.new_empty(0)
    return dx, dw


@_lce_backward_op.register_fake
def _(dloss: Any, dlse: Any, hidden: torch.Tensor, weight: torch.Tensor, *args: Any) -> Any:
    need_dx, need_dw = args[-2], args[-1]
    return (hidden.new_empty(hidden.shape) if need_dx else hidden.new_empty(0)), (
        weight.new_empty(weight.shape) if need_dw else weight.new_empty(0)
    )


def _setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
    hidden, weight, targets, ignore_index, z_loss, softcap, group_name, nc, vb = inputs
    _loss, lse, local_all = output
    ctx.save_for_backward(hidden, weight, local_all, targets != ignore_index, lse)
    ctx.cfg = (z_loss, softcap, group_name, nc, vb)
    ctx.mark_non_differentiable(local_all)
    ctx.set_materialize_grads(False)


def _backward(
    ctx: Any, dloss: torch.Tensor | None, dlse: torch.Tensor | None, _dlocal: Any
) -> tuple[Any, ...]:
    hidden, weight, local_all, valid, lse = ctx.saved_tensors
    need_dx, need_dw = _returned(ctx.needs_input_grad[0], ctx.needs_input_grad[1])
    if not (need_dx or need_dw) or (dloss is None and dlse is None):
        return (None,) * 9
    dx, dw = _lce_backward_op(dloss, dlse, hidden, weight, local_all, valid, lse, *ctx.cfg, need_dx, need_dw)
    return (dx if need_dx else None), (dw if need_dw else None), None, None, None, None, None, None, None


lce_op.register_autograd(_backward, setup_context=_setup)


# --------------------------------------------------------------------------------------------
# One-pass mode: the gradients of the summed loss are computed in the forward
# --------------------------------------------------------------------------------------------
