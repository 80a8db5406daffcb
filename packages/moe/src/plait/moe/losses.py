"""Load-balancing losses of a router, as pure functions of its scores and choices.

All take fp32 inputs and return a fp32 scalar that carries gradient to the router scores/logits.
An optional ``token_mask`` ``[T]`` (True = real token, False = padding) leaves padding tokens out
of every statistic, as transformers' ``attention_mask`` argument does.

Under context parallelism the tokens of each sequence are split over a ``group`` of ranks; given
that group, the losses sum their statistics (token counts, probability sums) over it, so every rank
gets the loss of the whole sequences, and the probability sums are all-reduced differentiably: the
gradients summed over the group's ranks equal those of the one-process loss.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor


class _AllReduceSum(torch.autograd.Function):
    """Sum over a group; the backward sums the gradients over it too (every rank's loss uses the sum)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _sum_over(group: dist.ProcessGroup | None, grad_sum: Tensor, no_grad: Tensor) -> tuple[Tensor, Tensor]:
    """All-reduce (sum) ``grad_sum`` differentiably and ``no_grad`` plainly over ``group`` (None: as is)."""
    if group is None:
        return grad_sum, no_grad
    no_grad = no_grad.clone()
    dist.all_reduce(no_grad, group=group)
    return _AllReduceSum.apply(grad_sum, group), no_grad


def count_tokens_per_expert(topk_idx: Tensor, num_experts: int, token_mask: Tensor | None = None) -> Tensor:
    """Assignments per expert, int64 ``[E]``, without a device sync (no ``bincount``).

    Indices equal to ``num_experts`` (dropped slots) and the rows of padding tokens (``token_mask``
    False) are not counted.
    """
    if token_mask is not None:
        topk_idx = torch.where(token_mask.reshape(-1, 1), topk_idx, num_experts)
    flat = topk_idx.reshape(-1)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int64))
    return counts[:num_experts]


def balancing_probs(scores: Tensor, score_func: str) -> Tensor:
    """Per-token probabilities over experts used by the balancing losses.

    Softmax scores are already a distribution; sigmoid scores are normalised per token (DeepSeek-V3);
    for ``"softmax_over_topk"`` ``scores`` are the logits and the probabilities their softmax over all
    experts (what transformers' ``load_balancing_loss_func`` takes for gpt-oss).
    """
    if score_func == "sigmoid":
        return scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    if score_func == "softmax_over_topk":
        return torch.softmax(scores, dim=-1)
    return scores


def _token_weights(token_mask: Tensor | None, num_tokens: int, like: Tensor) -> Tensor:
    """fp32 ``[T]``: 1 for real tokens, 0 for padding."""
    if token_mask is None:
        return like.new_ones(num_tokens)
    return token_mask.reshape(-1).to(like.dtype)


def switch_loss_stats(
    probs: Tensor,
    topk_idx: Tensor,
    num_experts: int,
    token_mask: Tensor | None = None,
    group: dist.ProcessGroup | None = None,
) -> Tensor:
    """The additive statistics of the Switch loss, fp32 ``[2E + 1]``.

    Layout: ``[counts (E), prob_sums (E), tokens (1)]``: assignments per expert (no gradient), the sum
    over tokens of each expert's router probability (carries gradient), and the number of tokens.
    Statistics of several layers (or of several ranks' tokens) add up; :func:`switch_aux_loss_from_stats`
    of the sum is the loss of the pooled assignments, which is how transformers'
    ``load_balancing_loss_func`` pools the router outputs of all layers.

    Args:
        probs: ``[T, E]`` fp32 router probabilities.
        topk_idx: ``[T, k]`` chosen experts.
        num_experts: E.
        token_mask: ``[T]`` bool, False = padding (left out).
        group: Context-parallel group whose ranks hold the other tokens of the sequences: the
            statistics are summed over it (the probability sums differentiably).
    """
    w = _token_weights(token_mask, probs.shape[0], probs)
    counts = count_tokens_per_expert(topk_idx, num_experts, token_mask).to(probs.dtype)
    prob_sums = (probs * w[:, None]).sum(dim=0)
    prob_sums, plain = _sum_over(group, prob_sums, torch.cat([counts, w.sum().reshape(1)]))
    return torch.cat([plain[:num_experts], prob_sums, plain[num_experts:]])


def switch_aux_loss_from_stats(stats: Tensor) -> Tensor:
    """Switch loss ``E * sum_i f_i P_i`` of (summed) :func:`switch_loss_stats`.

    ``f_i`` = assignments of expert i / tokens, ``P_i`` = mean router probability of expert i; with
    statistics pooled over L layers both are averaged over the ``L * T`` rows (transformers'
    ``load_balancing_loss_func``). No tokens give 0.
    """
    num_experts = (stats.numel() - 1) // 2
    counts, prob_sums = stats[:num_experts], stats[num_experts : 2 * num_experts]
    tokens = stats[2 * num_experts].clamp(min=1.0)
    return num_experts * torch.sum((counts / tokens) * (prob_sums / tokens))


def switch_aux_loss(
    probs: Tensor,
    topk_idx: Tensor,
    num_experts: int,
    token_mask: Tensor | None = None,
    group: dist.ProcessGroup | None = None,
) -> Tensor:
    """Switch-Transformer load-balancing loss, as Hugging Face computes it for one layer.

    ``E * sum_i f_i * P_i`` with ``f_i`` = assignments to expert i / tokens and ``P_i`` = mean router
    probability of expert i. With top-k routing a perfectly balanced router gives ``k`` (HF's
    ``load_balancing_loss_func`` does not divide by k; neither do we, so coefficients transfer).

    Args:
        probs: ``[T, E]`` fp32 router probabilities.
        topk_idx: ``[T, k]`` chosen experts.
        num_experts: E.
        token_mask: ``[T]`` bool, False = padding (left out).
        group: Context-parallel group whose ranks hold the other tokens of the sequences.
    """
    return switch_aux_loss_from_stats(switch_loss_stats(probs, topk_idx, num_experts, token_mask, group))


def seq_aux_loss(
    probs: Tensor,
    topk_idx: Tensor,
    num_experts: int,
    num_sequences: int,
    token_mask: Tensor | None = None,
    group: dist.ProcessGroup | None = None,
) -> Tensor:
    """DeepSeek-V3 sequence-wise balancing loss, averaged over sequences.

    Per sequence of S (real) tokens: ``sum_i f_i * P_i`` with ``f_i = E / (k S) * count_i`` and
    ``P_i`` the mean probability of expert i over the sequence. A balanced router gives 1.

    Args:
        probs: ``[B*S, E]`` fp32 probabilities (sigmoid scores normalised per token).
        topk_idx: ``[B*S, k]`` chosen experts.
        num_experts: E.
        num_sequences: B; tokens are laid out sequence-major.
        token_mask: ``[B*S]`` bool, False = padding (left out).
        group: Context-parallel group whose ranks hold the other tokens of the sequences.
    """
    num_tokens, top_k = topk_idx.shape
    if num_tokens == 0 and group is None:
        return probs.sum() * 0.0
    if num_tokens % num_sequences:
        raise ValueError(f"seq_aux_loss: {num_tokens} tokens do not split into {num_sequences} sequences")
    seq_len = num_tokens // num_sequences
    w = _token_weights(token_mask, num_tokens, probs)
    idx = topk_idx.reshape(num_sequences, seq_len * top_k)
    counts = torch.zeros(num_sequences, num_experts, dtype=probs.dtype, device=probs.device)
    counts.scatter_add_(1, idx, w.repeat_interleave(top_k).view_as(idx))
    real = w.view(num_sequences, seq_len).sum(dim=1, keepdim=True)
    prob_sums = (probs * w[:, None]).reshape(num_sequences, seq_len, num_experts).sum(dim=1)
    prob_sums, plain = _sum_over(group, prob_sums, torch.cat([counts, real], dim=1))
    counts, real = plain[:, :num_experts], plain[:, num_experts:]
    frac = counts * num_experts / (top_k * real.clamp(min=1.0))
    per_seq = (frac * prob_sums / real.clamp(min=1.0)).sum(dim=1)
    # Mean over the sequences that hold real tokens (all of them without a mask).
    return per_seq.sum() / (real > 0).sum().clamp(min=1)


def router_z_loss(
    logits: Tensor, token_mask: Tensor | None = None, group: dist.ProcessGroup | None = None
) -> Tensor:
    """ST-MoE router z-loss: mean over (real) tokens of ``logsumexp(logits)^2`` (fp32).

    With a context-parallel ``group`` the mean runs over the tokens of all its ranks.
    """
    if logits.shape[0] == 0 and group is None:
        return logits.float().sum() * 0.0
    z = torch.logsumexp(logits.float(), dim=-1).square()
    w = _token_weights(token_mask, z.shape[0], z)
    z_sum, total = _sum_over(group, (z * w).sum(), w.sum())
    return z_sum / total.clamp(min=1.0)
