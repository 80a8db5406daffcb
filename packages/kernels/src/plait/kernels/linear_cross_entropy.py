"""Linear + cross-entropy without materialising the ``[N, V]`` logits.

The loss is computed block by block: the tokens are split into chunks and the vocabulary into
blocks; each ``[chunk, block]`` logit tile comes from one matmul, is folded into a running
(max, sum-exp, target-logit) per token and thrown away. The backward recomputes each tile, turns
it into ``dlogits`` in place (``softmax - onehot`` with z-loss / soft-cap terms), and feeds it to
the two gradient matmuls: ``dhidden += dlogits @ W_blk`` (fp32 accumulator per token chunk) and
``dW_blk += dlogits^T @ hidden_chunk`` (written straight into the gradient). Peak extra memory is
the gradients plus one tile and one fp32 chunk accumulator.

One-pass mode (``grad_in_forward``; the default whenever the loss is reduced to a scalar, no lse is
returned, no process group is given and a gradient is wanted): the forward computes the gradients
of the summed loss too, in one pass over token chunks with the whole vocabulary: per chunk one
``[chunk, V]`` logits matmul, one row kernel for the per-token loss and ``dlogits`` in place (it
sweeps each row twice), ``dhidden_c = dlogits @ W`` and ``dW (+)= dlogits^T @ hidden_c``. Three
passes over the classifier instead of four, and four launches per chunk; the backward only scales
the stored gradients by the incoming scalar (one kernel each, fp32 math, cast to the input dtype)
and returns those the grad-direction switch asks for (the work is done either way). ``dW``
accumulates over the chunks in the input dtype, like the two-pass backward (the op's docstring says
why). Peak extra memory in the forward: one ``[chunk, V]`` tile (<= 256M entries by default) plus
``dW`` and ``dhidden`` in the input dtype; the two gradients live until the backward (a schedule
that runs several forwards before their backwards holds a pair per forward: pass
``grad_in_forward=False`` there), whose scaling adds the scaled copy of each. Gradient work is done
even if no backward follows; under ``torch.no_grad()`` the two-pass forward runs.

With ``process_group`` the classifier is sharded over the vocabulary (rank r holds a contiguous
slice; slices may differ in size): per-token statistics are combined with two all-reduces and the
hidden gradient is all-reduced in the backward.

Matmuls run in the input dtype (cuBLAS on GPU); the softmax arithmetic is fp32 (Triton kernels on
CUDA / under ``TRITON_INTERPRET=1``, PyTorch otherwise). The op is the torch custom op
``plait::linear_cross_entropy`` (``plait::linear_cross_entropy_fused`` in one-pass mode), traced by
``torch.compile`` without a graph break; the process group travels as its name.
"""

from __future__ import annotations

import math
from typing import Any, Literal, cast

import torch
import torch.distributed as dist
from plait.kernels._dispatch import use_triton
from plait.kernels.grad_direction import _returned, _weights_wanted

__all__ = ["linear_cross_entropy", "linear_cross_entropy_reference"]

Reduction = Literal["mean", "sum", "none"]


def linear_cross_entropy_reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: Reduction = "mean",
    z_loss: float = 0.0,
    softcap: float | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Materialising reference: ``logits = hidden @ weight.T`` then the same loss in fp32 (or the input's precision if higher)."""
    ct = torch.promote_types(hidden.dtype, torch.float32)
    logits = (hidden @ weight.T).to(ct)
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    lse = torch.logsumexp(logits, -1)
    valid = targets != ignore_index
    tgt = logits.gather(1, torch.where(valid, targets, 0).unsqueeze(1)).squeeze(1)
    loss = torch.where(valid, lse - tgt + z_loss * lse * lse, 0.0)
    loss = _reduce(loss, valid, reduction)
    return (loss, lse) if return_lse else loss


def _reduce(loss: torch.Tensor, valid: torch.Tensor, reduction: str) -> torch.Tensor:
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    # Mean over non-ignored tokens; an all-ignored batch gives 0 (not NaN) so that empty
    # pipeline micro-batches do not poison the step.
    return loss.sum() / valid.sum().clamp(min=1).to(loss.dtype)


# --------------------------------------------------------------------------------------------
# Per-tile elementwise steps (PyTorch versions; Triton versions in _triton/linear_cross_entropy)
# --------------------------------------------------------------------------------------------


def _tile_stats_torch(
    logits: torch.Tensor,
    local_t: torch.Tensor,
    m: torch.Tensor,
    s: torch.Tensor,
    tgt: torch.Tensor,
    softcap: float | None,
) -> None:
    z = logits.float()
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    new_m = torch.maximum(m, z.max(1).values)
    s.mul_(torch.exp(m - new_m)).add_(torch.exp(z - new_m[:, None]).sum(1))
    m.copy_(new_m)
    inside = (local_t >= 0) & (local_t < z.shape[1])
    tgt.add_(torch.where(inside, z.gather(1, local_t.clamp(0, z.shape[1] - 1)[:, None]).squeeze(1), 0.0))


def _tile_grad_torch(
    logits: torch.Tensor,
    local_t: torch.Tensor,
    lse: torch.Tensor,
    g_p: torch.Tensor,
    g_t: torch.Tensor,
    softcap: float | None,
) -> torch.Tensor:
    # dlogit_j = g_p * softmax_j - g_t * onehot_j  (times d softcap / d logit)
    z = logits.float()
    if softcap is not None:
        th = torch.tanh(z / softcap)
        z = softcap * th
    d = torch.exp(z - lse[:, None]) * g_p[:, None]
    inside = (local_t >= 0) & (local_t < z.shape[1])
    idx = local_t.clamp(0, z.shape[1] - 1)[:, None]
    d.scatter_add_(1, idx, torch.where(inside, -g_t, 0.0)[:, None])
    if softcap is not None:
        d = d * (1.0 - th * th)
    return logits.copy_(d)  # in place, like the Triton kernel


def _tile_ops(triton: bool) -> tuple[Any, Any]:
    if triton:
        from plait.kernels._triton.linear_cross_entropy import tile_grad_triton, tile_stats_triton

        return tile_stats_triton, tile_grad_triton
    return _tile_stats_torch, _tile_grad_torch


def _chunks(
    n_tokens: int, hidden: int, vocab: int, chunk_tokens: int | None, chunk_vocab: int | None
) -> tuple[int, int]:
    # Defaults keep the fp32 [chunk, H] accumulator at ~32 MiB and one [chunk, block] tile (input dtype)
    # at up to 64M entries, with blocks of 4k-16k vocabulary entries: large enough that the matmuls
    # run at full rate and that few tiles (each a handful of kernel launches) cover the vocabulary.
    nc = chunk_tokens or min(n_tokens, max(256, (8 * 1024 * 1024) // max(hidden, 1)))
    vb = chunk_vocab or min(vocab, max(4096, min(16384, (64 * 1024 * 1024) // max(nc, 1))))
    return max(1, nc), max(1, vb)


def _group(name: str | None) -> dist.ProcessGroup | None:
    if name is None:
        return None
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(cast(Any, name))  # a str; newer torch types it as GroupName


def _vocab_offset(local_vocab: int, group: dist.ProcessGroup | None, device: torch.device) -> int:
    if group is None:
        return 0
    # Shards may differ in size: gather them (one tiny tensor collective, NCCL- and gloo-friendly).
    world = dist.get_world_size(group)
    mine = torch.tensor([local_vocab], dtype=torch.int64, device=device)
    sizes = torch.empty(world, dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(sizes, mine, group=group)
    return int(sizes[: dist.get_rank(group)].sum())


@torch.library.custom_op(
    "plait::linear_cross_entropy",
    mutates_args=(),
    schema="(Tensor hidden, Tensor weight, Tensor targets, int ignore_index, float z_loss, float? softcap, "
    "str? group_name, int chunk_tokens, int chunk_vocab) -> (Tensor, Tensor, Tensor)",
)
def _lce_op(
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
    group = _group(group_name)
    stats, _ = _tile_ops(use_triton(hidden, weight))
    v0 = _vocab_offset(v, group, hidden.device)
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


@_lce_op.register_fake
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
        _, grad = _tile_ops(use_triton(hidden, weight))
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
            if dx is not None and acc is not None:
                dx[a : a + nc] = acc
        group = _group(group_name)
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


_lce_op.register_autograd(_backward, setup_context=_setup)


# --------------------------------------------------------------------------------------------
# One-pass mode: the gradients of the summed loss are computed in the forward
# --------------------------------------------------------------------------------------------


def _one_pass_chunks(
    n_tokens: int, vocab: int, chunk_tokens: int | None, chunk_vocab: int | None
) -> tuple[int, int]:
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
    _tile_stats_torch(logits, local_t, m, s, tgt, softcap)
    lse = m + torch.log(s)
    valid = local_t >= 0
    loss.copy_(torch.where(valid, lse - tgt + z_loss * lse * lse, 0.0))
    # Gradient of the summed loss: d(loss)/d(lse) = 1 + 2 z lse on valid tokens, 0 elsewhere.
    g_t = valid.float()
    _tile_grad_torch(logits, local_t, lse, g_t * (1.0 + 2.0 * z_loss * lse), g_t, softcap)


def _scale_torch(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    return (x.float() * g).to(x.dtype)


def _one_pass_ops(triton: bool) -> tuple[Any, Any]:
    if triton:
        from plait.kernels._triton.linear_cross_entropy import row_loss_grad_triton, scale_triton

        return row_loss_grad_triton, scale_triton
    return _row_loss_grad_torch, _scale_torch


@torch.library.custom_op(
    "plait::linear_cross_entropy_fused",
    mutates_args=(),
    schema="(Tensor hidden, Tensor weight, Tensor targets, int ignore_index, float z_loss, float? softcap, "
    "int chunk_tokens, int chunk_vocab, bool need_dx, bool need_dw) -> (Tensor, Tensor, Tensor)",
)
def _lce_fused_op(
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
    return loss.sum(), dx, dw


@_lce_fused_op.register_fake
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


def _fused_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
    _loss, dx, dw = output
    ctx.save_for_backward(dx, dw)
    ctx.computed = inputs[-2:]  # need_dx, need_dw
    ctx.mark_non_differentiable(dx, dw)
    ctx.set_materialize_grads(False)


def _fused_backward(ctx: Any, dloss: torch.Tensor | None, _ddx: Any, _ddw: Any) -> tuple[Any, ...]:
    dx, dw = ctx.saved_tensors
    has_dx, has_dw = ctx.computed
    need_dx, need_dw = _returned(ctx.needs_input_grad[0] and has_dx, ctx.needs_input_grad[1] and has_dw)
    if dloss is None or not (need_dx or need_dw):
        return (None,) * 10
    gx, gw = _lce_fused_backward_op(dloss, dx, dw, need_dx, need_dw)
    return (gx if need_dx else None), (gw if need_dw else None), *(None,) * 8


_lce_fused_op.register_autograd(_fused_backward, setup_context=_fused_setup)


def _one_pass_blocker(
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


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: Reduction = "mean",
    z_loss: float = 0.0,
    softcap: float | None = None,
    return_lse: bool = False,
    process_group: dist.ProcessGroup | None = None,
    backend: Literal["auto", "plait", "cce"] = "auto",
    chunk_tokens: int | None = None,
    chunk_vocab: int | None = None,
    grad_in_forward: bool | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy of ``hidden @ weight.T`` against ``targets`` without storing the logits.

    Args:
        hidden: ``[N, H]`` final hidden states (flatten batch and sequence first).
        weight: ``[V, H]`` classifier (``lm_head.weight``); with ``process_group`` the local
            vocabulary shard ``[V_r, H]``, shards ordered by rank (plain tensors: pass
            ``dtensor.to_local()`` for a DTensor).
        targets: ``[N]`` int64 global token ids; ``ignore_index`` entries contribute nothing.
        ignore_index: target value to skip.
        reduction: ``"mean"`` (over non-ignored tokens; 0 if all are ignored), ``"sum"`` or
            ``"none"`` (``[N]`` fp32, 0 at ignored tokens).
        z_loss: coefficient of the ``lse**2`` auxiliary term added to each token's loss.
        softcap: if set, logits are ``softcap * tanh(logits / softcap)`` (Gemma-2 style).
        return_lse: also return the fp32 ``[N]`` log-sum-exp (differentiable).
        process_group: vocabulary-parallel group, or ``None``.
        backend: ``"plait"`` (this implementation), ``"cce"`` (Apple's cut-cross-entropy, needs the
            ``plait-kernels[cce]`` extra; no z-loss / lse / process group / grad-direction switch),
            or ``"auto"`` (= ``"plait"``).
        chunk_tokens: tokens per chunk (memory/speed knob). Two-pass default: the fp32 accumulator
            is ~32 MiB; one-pass default: a multiple of 128 (at least 128) with a ``[chunk, V]``
            tile of at most 256M entries.
        chunk_vocab: vocabulary entries per tile (two-pass default 4096-16384: a tile of up to 64M
            entries); one-pass: columns per step of the row kernel's sweeps (default 8192).
        grad_in_forward: compute the gradients in the forward, in one pass over the classifier
            (module docstring). ``None``: whenever eligible (``reduction`` ``"mean"`` / ``"sum"``,
            no ``return_lse`` / ``process_group``, grad mode on and ``hidden`` or ``weight``
            requiring grad, ``backend`` not ``"cce"``); ``True``: require it (``ValueError`` naming
            the reason if not eligible); ``False``: the two-pass path.

    Returns:
        The loss in fp32 (scalar, or ``[N]`` for ``"none"``), and the lse if ``return_lse``.
        Gradients respect :func:`plait.kernels.grad_direction`.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"linear_cross_entropy: hidden {tuple(hidden.shape)} must be [N, H] and weight {tuple(weight.shape)} [V, H]"
        )
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"linear_cross_entropy: targets {tuple(targets.shape)} must be [{hidden.shape[0]}]")
    if targets.dtype.is_floating_point:
        raise ValueError(f"linear_cross_entropy: targets must be integer token ids, got {targets.dtype}")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"linear_cross_entropy: hidden dtype {hidden.dtype} != weight dtype {weight.dtype}")
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(
            f"linear_cross_entropy: reduction must be 'mean', 'sum' or 'none', got {reduction!r}"
        )
    if softcap is not None and softcap <= 0:
        raise ValueError(f"linear_cross_entropy: softcap must be positive, got {softcap}")
    blocker = _one_pass_blocker(hidden, weight, reduction, return_lse, process_group, backend)
    if grad_in_forward and blocker is not None:
        raise ValueError(f"linear_cross_entropy: grad_in_forward=True is not possible: {blocker}")
    if backend == "cce":
        if z_loss or return_lse or process_group is not None:
            raise ValueError(
                "linear_cross_entropy: backend='cce' supports neither z_loss, return_lse nor process_group"
            )
        try:
            from cut_cross_entropy import linear_cross_entropy as _cce
        except ImportError as e:
            raise ImportError(
                "linear_cross_entropy(backend='cce') needs cut-cross-entropy: pip install 'plait-kernels[cce]'"
            ) from e
        return _cce(hidden, weight, targets, ignore_index=ignore_index, softcap=softcap, reduction=reduction)
    if backend not in ("auto", "plait"):
        raise ValueError(
            f"linear_cross_entropy: unknown backend {backend!r} (expected 'auto', 'plait' or 'cce')"
        )
    targets = targets.long()
    if grad_in_forward is not False and blocker is None:
        nc, vb = _one_pass_chunks(hidden.shape[0], weight.shape[0], chunk_tokens, chunk_vocab)
        loss_sum, _dx, _dw = _lce_fused_op(
            hidden,
            weight,
            targets,
            ignore_index,
            float(z_loss),
            None if softcap is None else float(softcap),
            nc,
            vb,
            hidden.requires_grad,
            weight.requires_grad,
        )
        return _reduce(loss_sum, targets != ignore_index, reduction)
    nc, vb = _chunks(hidden.shape[0], hidden.shape[1], weight.shape[0], chunk_tokens, chunk_vocab)
    group_name = process_group.group_name if process_group is not None else None
    loss, lse, _local = _lce_op(
        hidden,
        weight,
        targets,
        ignore_index,
        float(z_loss),
        None if softcap is None else float(softcap),
        group_name,
        nc,
        vb,
    )
    loss = _reduce(loss, targets != ignore_index, reduction)
    return (loss, lse) if return_lse else loss
