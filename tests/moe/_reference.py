"""Independent float64 reference MoE (per-expert loop, Python capacity), used by the moe tests."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def kept_assignments(
    idx: torch.Tensor, w: torch.Tensor, num_experts: int, cf: float | None, policy: str
) -> torch.Tensor:
    """Bool ``[T, k]``: which assignments survive the capacity limit (brute force)."""
    t, k = idx.shape
    if cf is None:
        return torch.ones(t, k, dtype=torch.bool)
    cap = math.ceil(cf * t * k / num_experts)
    keep = torch.zeros(t, k, dtype=torch.bool)
    for e in range(num_experts):
        slots = [(a, b) for a in range(t) for b in range(k) if int(idx[a, b]) == e]
        if policy == "probs":
            slots.sort(key=lambda s: -float(w[s]))
        for s in slots[:cap]:
            keep[s] = True
    return keep


def reference_moe(
    x: torch.Tensor,
    params: dict[str, torch.Tensor],
    top_k: int,
    norm_topk_prob: bool = False,
    aux_loss_coef: float = 0.0,
    capacity_factor: float | None = None,
    drop_policy: str = "probs",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Softmax top-k MoE on ``x`` ``[T, H]`` with HF-Qwen3 semantics.

    ``params`` holds ``router.weight``, ``experts.gate_up_proj``, ``experts.down_proj`` and optionally
    the shared expert's weights. Returns ``(y, aux_loss, counts)``.
    """
    wr = params["router.weight"]
    gate_up, down = params["experts.gate_up_proj"], params["experts.down_proj"]
    num_experts, inter = gate_up.shape[0], gate_up.shape[1] // 2
    probs = torch.softmax(x @ wr.T, dim=-1)
    topw, idx = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        topw = topw / topw.sum(-1, keepdim=True)
    keep = kept_assignments(idx, topw.detach(), num_experts, capacity_factor, drop_policy)
    y = torch.zeros_like(x)
    for e in range(num_experts):
        tok, slot = torch.where((idx == e) & keep)
        if tok.numel() == 0:
            continue
        h = x[tok] @ gate_up[e].T
        h = F.silu(h[:, :inter]) * h[:, inter:]
        y = y.index_add(0, tok, (h @ down[e].T) * topw[tok, slot, None])
    if "shared_expert.gate_proj.weight" in params:
        s = F.silu(x @ params["shared_expert.gate_proj.weight"].T) * (
            x @ params["shared_expert.up_proj.weight"].T
        )
        s = s @ params["shared_expert.down_proj.weight"].T
        if "shared_expert_gate.weight" in params:
            s = torch.sigmoid(x @ params["shared_expert_gate.weight"].T) * s
        y = y + s
    counts = torch.bincount(idx.flatten(), minlength=num_experts)
    aux = x.new_zeros(())
    if aux_loss_coef:
        aux = aux_loss_coef * num_experts * (counts.to(x.dtype) / x.shape[0] * probs.mean(0)).sum()
    return y, aux, counts
