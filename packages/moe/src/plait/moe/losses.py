"""Load-balancing losses of a router, as pure functions of its scores and choices.

All take fp32 inputs and return a fp32 scalar that carries gradient to the router scores/logits.

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
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _sum_over(group: Any, grad_sum: Tensor, no_grad: Tensor) -> tuple[Tensor, Tensor]:
    """All-reduce (sum) ``grad_sum`` differentiably and ``no_grad`` plainly over ``group`` (None: as is)."""
    if group is None:
        return grad_sum, no_grad
    no_grad = no_grad.clone()
    dist.all_reduce(no_grad, group=group)
    return _AllReduceSum.apply(grad_sum, group), no_grad


def count_tokens_per_expert(topk_idx: Tensor, num_experts: int) -> Tensor:
    """Assignments per expert, int64 ``[E]``, without a device sync (no ``bincount``).

    Indices equal to ``num_experts`` (dropped slots) are not counted.
    """
    flat = topk_idx.reshape(-1)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int64))
    return counts[:num_experts]


def balancing_probs(scores: Tensor, score_func: str) -> Tensor:
    """Per-token probabilities over experts used by the balancing losses.

    Softmax scores are already a distribution; sigmoid scores are normalised per token (DeepSeek-V3).
    """
    if score_func == "sigmoid":
        return scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    return scores


def switch_aux_loss(probs: Tensor, topk_idx: Tensor, num_experts: int, group: Any = None) -> Tensor:
    """Switch-Transformer load-balancing loss, as Hugging Face computes it for one layer.

    ``E * sum_i f_i * P_i`` with ``f_i`` = assignments to expert i / tokens and ``P_i`` = mean router
    probability of expert i. With top-k routing a perfectly balanced router gives ``k`` (HF's
    ``load_balancing_loss_func`` does not divide by k; neither do we, so coefficients transfer).

    Args:
        probs: ``[T, E]`` fp32 router probabilities.
        topk_idx: ``[T, k]`` chosen experts.
        num_experts: E.
        group: Context-parallel group whose ranks hold the other tokens of the sequences.
    """
    if group is not None:
        counts = count_tokens_per_expert(topk_idx, num_experts).to(probs.dtype)
        stats = torch.cat([counts, counts.new_tensor([probs.shape[0]])])
        prob_sum, stats = _sum_over(group, probs.sum(dim=0), stats)
        total = stats[-1].clamp(min=1)
        return num_experts * torch.sum(stats[:-1] / total * prob_sum / total)
    num_tokens = probs.shape[0]
    if num_tokens == 0:
        return probs.sum() * 0.0
    frac = count_tokens_per_expert(topk_idx, num_experts).to(probs.dtype) / num_tokens
    return num_experts * torch.sum(frac * probs.mean(dim=0))


def seq_aux_loss(
    probs: Tensor, topk_idx: Tensor, num_experts: int, num_sequences: int, group: Any = None
) -> Tensor:
    """DeepSeek-V3 sequence-wise balancing loss, averaged over sequences.

    Per sequence of S tokens: ``sum_i f_i * P_i`` with ``f_i = E / (k S) * count_i`` and ``P_i`` the
    mean probability of expert i over the sequence. A balanced router gives 1.

    Args:
        probs: ``[B*S, E]`` fp32 probabilities (sigmoid scores normalised per token).
        topk_idx: ``[B*S, k]`` chosen experts.
        num_experts: E.
        num_sequences: B; tokens are laid out sequence-major.
        group: Context-parallel group whose ranks hold the other tokens of the sequences.
    """
    num_tokens, top_k = topk_idx.shape
    if num_tokens == 0 and group is None:
        return probs.sum() * 0.0
    if num_tokens % num_sequences:
        raise ValueError(f"seq_aux_loss: {num_tokens} tokens do not split into {num_sequences} sequences")
    seq_len = num_tokens // num_sequences
    idx = topk_idx.reshape(num_sequences, seq_len * top_k)
    counts = torch.zeros(num_sequences, num_experts, dtype=probs.dtype, device=probs.device)
    counts.scatter_add_(1, idx, torch.ones_like(idx, dtype=probs.dtype))
    prob_sum = probs.reshape(num_sequences, seq_len, num_experts).sum(dim=1)
    if group is not None:
        prob_sum, counts = _sum_over(group, prob_sum, counts)
        seq_len *= dist.get_world_size(group)
    frac = counts * (num_experts / (top_k * seq_len))
    return (frac * prob_sum / seq_len).sum(dim=1).mean()


def router_z_loss(logits: Tensor, group: Any = None) -> Tensor:
    """ST-MoE router z-loss: mean over tokens of ``logsumexp(logits)^2`` (fp32).

    With a context-parallel ``group`` the mean runs over the tokens of all its ranks.
    """
    if group is not None:
        z_sum, total = _sum_over(
            group,
            torch.logsumexp(logits.float(), dim=-1).square().sum(),
            torch.tensor(float(logits.shape[0]), device=logits.device),
        )
        return z_sum / total.float().clamp(min=1)
    if logits.shape[0] == 0:
        return logits.float().sum() * 0.0
    return torch.logsumexp(logits.float(), dim=-1).square().mean()
