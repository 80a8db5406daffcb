"""``linear_cross_entropy``: checks its arguments and picks the one-pass, two-pass or CCE path."""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist
from plait.kernels.linear_cross_entropy.cce import cce_linear_cross_entropy
from plait.kernels.linear_cross_entropy.one_pass import lce_fused, one_pass_blocker, one_pass_chunks
from plait.kernels.linear_cross_entropy.reference import Reduction, reduce_loss
from plait.kernels.linear_cross_entropy.two_pass import lce_op, two_pass_chunks

__all__ = ["linear_cross_entropy"]


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
    blocker = one_pass_blocker(hidden, weight, reduction, return_lse, process_group, backend)
    if grad_in_forward and blocker is not None:
        raise ValueError(f"linear_cross_entropy: grad_in_forward=True is not possible: {blocker}")
    if backend == "cce":
        if z_loss or return_lse or process_group is not None:
            raise ValueError(
                "linear_cross_entropy: backend='cce' supports neither z_loss, return_lse nor process_group"
            )
        return cce_linear_cross_entropy(
            hidden, weight, targets, ignore_index=ignore_index, softcap=softcap, reduction=reduction
        )
    if backend not in ("auto", "plait"):
        raise ValueError(
            f"linear_cross_entropy: unknown backend {backend!r} (expected 'auto', 'plait' or 'cce')"
        )
    targets = targets.long()
    if grad_in_forward is not False and blocker is None:
        nc, vb = one_pass_chunks(hidden.shape[0], weight.shape[0], chunk_tokens, chunk_vocab)
        loss_sum, _dx, _dw = lce_fused(
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
        return reduce_loss(loss_sum, targets != ignore_index, reduction)
    nc, vb = two_pass_chunks(hidden.shape[0], hidden.shape[1], weight.shape[0], chunk_tokens, chunk_vocab)
    group_name = process_group.group_name if process_group is not None else None
    loss, lse, _local = lce_op(
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
    loss = reduce_loss(loss, targets != ignore_index, reduction)
    return (loss, lse) if return_lse else loss
