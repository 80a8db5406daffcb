"""Load-balancing losses of a router, as pure functions of its scores and choices.

All take fp32 inputs and return a fp32 scalar that carries gradient to the router scores/logits.
"""

from __future__ import annotations

import torch
from torch import Tensor


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


def switch_aux_loss(probs: Tensor, topk_idx: Tensor, num_experts: int) -> Tensor:
    """Switch-Transformer load-balancing loss, as Hugging Face computes it for one layer.

    ``E * sum_i f_i * P_i`` with ``f_i`` = assignments to expert i / tokens and ``P_i`` = mean router
    probability of expert i. With top-k routing a perfectly balanced router gives ``k`` (HF's
    ``load_balancing_loss_func`` does not divide by k; neither do we, so coefficients transfer).

    Args:
        probs: ``[T, E]`` fp32 router probabilities.
        topk_idx: ``[T, k]`` chosen experts.
        num_experts: E.
    """
    num_tokens = probs.shape[0]
    if num_tokens == 0:
        return probs.sum() * 0.0
    frac = count_tokens_per_expert(topk_idx, num_experts).to(probs.dtype) / num_tokens
    return num_experts * torch.sum(frac * probs.mean(dim=0))


def seq_aux_loss(probs: Tensor, topk_idx: Tensor, num_experts: int, num_sequences: int) -> Tensor:
    """DeepSeek-V3 sequence-wise balancing loss, averaged over sequences.

    Per sequence of S tokens: ``sum_i f_i * P_i`` with ``f_i = E / (k S) * count_i`` and ``P_i`` the
    mean probability of expert i over the sequence. A balanced router gives 1.

    Args:
        probs: ``[B*S, E]`` fp32 probabilities (sigmoid scores normalised per token).
        topk_idx: ``[B*S, k]`` chosen experts.
        num_experts: E.
        num_sequences: B; tokens are laid out sequence-major.
    """
    num_tokens, top_k = topk_idx.shape
    if num_tokens == 0:
        return probs.sum() * 0.0
    if num_tokens % num_sequences:
        raise ValueError(f"seq_aux_loss: {num_tokens} tokens do not split into {num_sequences} sequences")
    seq_len = num_tokens // num_sequences
    idx = topk_idx.reshape(num_sequences, seq_len * top_k)
    counts = torch.zeros(num_sequences, num_experts, dtype=probs.dtype, device=probs.device)
    counts.scatter_add_(1, idx, torch.ones_like(idx, dtype=probs.dtype))
    frac = counts * (num_experts / (top_k * seq_len))
    mean_probs = probs.reshape(num_sequences, seq_len, num_experts).mean(dim=1)
    return (frac * mean_probs).sum(dim=1).mean()


def router_z_loss(logits: Tensor) -> Tensor:
    """ST-MoE router z-loss: mean over tokens of ``logsumexp(logits)^2`` (fp32)."""
    if logits.shape[0] == 0:
        return logits.float().sum() * 0.0
    return torch.logsumexp(logits.float(), dim=-1).square().mean()
