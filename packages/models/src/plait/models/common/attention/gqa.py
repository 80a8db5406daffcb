"""Grouped-query attention: q/k/v/o projections, optional per-head q/k RMSNorm (Qwen3), RoPE,
optional learned sinks (gpt-oss), a sliding window and a sigmoid output gate (the gated-DeltaNet
hybrids' full-attention layers), on the kernels of :mod:`.core`."""

from __future__ import annotations

import torch
from plait.models.common.attention.core import attention
from plait.models.common.attention.mask import AttentionMask
from plait.models.common.config import DecoderConfig
from plait.models.common.norm import RMSNorm
from plait.models.common.rope import apply_rotary
from torch import nn

__all__ = ["GroupedQueryAttention"]


class GroupedQueryAttention(nn.Module):
    """Multi-head attention with fewer key/value heads than query heads (down to one).

    Under tensor parallelism q/k/v are column-parallel and o is row-parallel (``sinks`` sharded by
    head): the local head count is read from the projection outputs, so the same forward serves
    sharded and unsharded modules.

    Args:
        hidden_size: Model width.
        num_heads: Query heads.
        num_kv_heads: Key/value heads.
        head_dim: Per-head width.
        bias: Bias on the four projections.
        eps: RMSNorm epsilon of q_norm/k_norm.
        qk_norm: Per-head RMSNorm on q and k before RoPE (Qwen3).
        sinks: One learned sink logit per query head (gpt-oss), parameter ``sinks [num_heads]``.
        sliding_window: Keys each query sees (itself included); None = full causal attention.
        output_gate: ``q_proj`` also produces a per-head gate (its rows per head: ``head_dim``
            query rows, then ``head_dim`` gate rows); the attention output is multiplied by
            ``sigmoid(gate)`` before ``o_proj``.
        norm_offset: Weight offset of q_norm/k_norm (``1.0``: zero-centred, see :class:`RMSNorm`).
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        bias: bool,
        eps: float = 1e-6,
        *,
        qk_norm: bool = True,
        sinks: bool = False,
        sliding_window: int | None = None,
        output_gate: bool = False,
        norm_offset: float = 0.0,
    ) -> None:
        super().__init__()
        self.output_gate = output_gate
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scaling = head_dim**-0.5
        self.sliding_window = sliding_window
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim * (2 if output_gate else 1), bias=bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=bias)
        self.q_norm = RMSNorm(head_dim, eps, norm_offset) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, eps, norm_offset) if qk_norm else None
        self.sinks = nn.Parameter(torch.empty(num_heads)) if sinks else None
        self.has_sinks = sinks

    @classmethod
    def from_config(
        cls,
        config: DecoderConfig,
        *,
        qk_norm: bool,
        sinks: bool = False,
        sliding_window: int | None = None,
        output_gate: bool = False,
    ) -> GroupedQueryAttention:
        """The attention of a config's layer (widths, heads, ``attention_bias``, ``rms_norm_eps``,
        the norms' ``rms_norm_offset``)."""
        return cls(
            config.hidden_size,
            config.num_attention_heads,
            config.kv_heads,
            config.resolved_head_dim,
            config.attention_bias,
            config.rms_norm_eps,
            qk_norm=qk_norm,
            sinks=sinks,
            sliding_window=sliding_window,
            output_gate=output_gate,
            norm_offset=config.rms_norm_offset,
        )

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: AttentionMask
    ) -> torch.Tensor:
        """``x [B, S, H]`` -> ``[B, S, H]``."""
        b, s, _ = x.shape
        gate = None
        if self.output_gate:
            q, gate = self.q_proj(x).reshape(b, s, -1, 2 * self.head_dim).chunk(2, dim=-1)
        else:
            q = self.q_proj(x).view(b, s, -1, self.head_dim)
        k = self.k_proj(x).view(b, s, -1, self.head_dim)
        v = self.v_proj(x).view(b, s, -1, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, k, *rope)
        sinks = None if self.sinks is None else _local(self.sinks)
        out = attention(q, k, v, mask, self.scaling, sinks).reshape(b, s, -1)
        if gate is not None:
            out = out * torch.sigmoid(gate.reshape(b, s, -1))
        return self.o_proj(out)

    def reset_parameters(self, std: float) -> None:
        """Normal(0, std) projections and sinks, zero biases, unit norms."""
        for lin in (self.q_proj, self.k_proj, self.v_proj, self.o_proj):
            nn.init.normal_(lin.weight, 0.0, std)
            if lin.bias is not None:
                nn.init.zeros_(lin.bias)
        for norm in (self.q_norm, self.k_norm):
            if norm is not None:
                norm.reset_parameters()
        if self.sinks is not None:
            nn.init.normal_(self.sinks, 0.0, std)


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t
