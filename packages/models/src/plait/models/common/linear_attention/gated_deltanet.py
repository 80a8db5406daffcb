"""Gated DeltaNet: the linear-attention token mixer of the gated-DeltaNet hybrids.

``x`` is projected to q, k, v (``linear_num_key_heads`` query/key heads, ``linear_num_value_heads``
value heads), the output gate ``z``, the write strength ``beta = sigmoid(b)`` and the decay input
``a``; q/k/v pass through a short causal depthwise convolution and SiLU; the gated delta rule
(:mod:`.delta_rule`) mixes the tokens with a per-head decay ``g = -exp(A_log) * softplus(a +
dt_bias)``; a gated RMSNorm (``silu(z)``) and ``out_proj`` finish. Packed documents (the mask's
``document_ids``) restart both the convolution and the recurrent state.

Two projection layouts exist (Hugging Face parameter names kept):

* ``"grouped"``: ``in_proj_qkvz [Hk * (2 dk + 2 r dv), H]`` and ``in_proj_ba [Hk * 2r, H]``, rows
  grouped per key head (``q, k, v, z`` of its ``r = Hv / Hk`` value heads; then ``b``, ``a``).
* ``"split"``: ``in_proj_qkv [2 Hk dk + Hv dv, H]`` (all q, all k, all v), ``in_proj_z``,
  ``in_proj_b``, ``in_proj_a``.
"""

from __future__ import annotations

import logging
from typing import Literal

import torch
import torch.nn.functional as F
from plait.models.common.attention import AttentionMask
from plait.models.common.linear_attention.conv import causal_conv1d
from plait.models.common.linear_attention.delta_rule import chunk_gated_delta_rule
from plait.models.common.linear_attention.fla import (
    FlaKernels,
    fla_causal_conv1d,
    fla_gated_delta_rule,
    fla_kernels,
    fla_unusable,
)
from plait.models.common.linear_attention.norm import GatedRMSNorm
from torch import nn

__all__ = ["GatedDeltaNet", "LinearAttentionImplementation", "ProjectionLayout"]

log = logging.getLogger("plait.models")

LinearAttentionImplementation = Literal["auto", "torch", "fla"]
ProjectionLayout = Literal["grouped", "split"]


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet token mixer (the decoder layer's ``self_attn`` slot).

    Args:
        hidden_size: Model width.
        num_k_heads: Query/key heads.
        num_v_heads: Value heads (a multiple of ``num_k_heads``).
        head_k_dim: Query/key head width.
        head_v_dim: Value head width.
        conv_kernel_size: Width of the causal convolution.
        eps: Epsilon of the gated RMSNorm.
        layout: Projection layout (see the module docstring).
        chunk_size: Tokens per chunk of the PyTorch delta rule.
        implementation: ``torch`` (plait's PyTorch path), ``fla`` (fla-core's kernels on CUDA,
            refused where fla cannot train; PyTorch on CPU) or ``auto`` (fla on CUDA where it can train:
            installed, and not fla's refused Hopper + Triton < 3.7.1 combination).
        layer_idx: Global index of the layer (in error messages).
    """

    sliding_window: int | None = None
    has_sinks: bool = False
    layer_type: str = "linear_attention"  # a SequentialMixer: context parallelism is refused

    def __init__(
        self,
        hidden_size: int,
        num_k_heads: int,
        num_v_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        conv_kernel_size: int,
        eps: float = 1e-6,
        *,
        layout: ProjectionLayout = "split",
        chunk_size: int = 64,
        implementation: LinearAttentionImplementation = "torch",
        layer_idx: int = 0,
    ) -> None:
        super().__init__()
        if num_v_heads % num_k_heads:
            raise ValueError(f"num_v_heads ({num_v_heads}) must be a multiple of num_k_heads ({num_k_heads})")
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.key_dim, self.value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        self.layout: ProjectionLayout = layout
        self.chunk_size = chunk_size
        self.implementation: LinearAttentionImplementation = implementation
        self.layer_idx = layer_idx
        self.fla = self._resolve_fla()
        conv_dim = 2 * self.key_dim + self.value_dim
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, conv_kernel_size, groups=conv_dim, bias=False)
        self.in_proj_qkvz: nn.Linear | None = None
        self.in_proj_ba: nn.Linear | None = None
        self.in_proj_qkv: nn.Linear | None = None
        self.in_proj_z: nn.Linear | None = None
        self.in_proj_b: nn.Linear | None = None
        self.in_proj_a: nn.Linear | None = None
        if layout == "grouped":
            self.in_proj_qkvz = nn.Linear(hidden_size, conv_dim + self.value_dim, bias=False)
            self.in_proj_ba = nn.Linear(hidden_size, 2 * num_v_heads, bias=False)
        else:
            self.in_proj_qkv = nn.Linear(hidden_size, conv_dim, bias=False)
            self.in_proj_z = nn.Linear(hidden_size, self.value_dim, bias=False)
            self.in_proj_b = nn.Linear(hidden_size, num_v_heads, bias=False)
            self.in_proj_a = nn.Linear(hidden_size, num_v_heads, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(num_v_heads))
        self.norm = GatedRMSNorm(head_v_dim, eps)
        self.out_proj = nn.Linear(self.value_dim, hidden_size, bias=False)

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``(qkv [B, S, 2 Hk dk + Hv dv] (all q, all k, all v), z [B, S, Hv, dv], b, a [B, S, Hv])``."""
        bsz, seq, _ = x.shape
        if self.in_proj_qkvz is not None and self.in_proj_ba is not None:
            r = self.num_v_heads // self.num_k_heads
            dk, rv = self.head_k_dim, r * self.head_v_dim
            # Split as 3-d tensors [B*S, Hk, .]: the backward of a split is a cat, and eager's cat of
            # 4-d gradients may pick channels-last strides that compiled graphs do not expect.
            qkvz = self.in_proj_qkvz(x).reshape(bsz * seq, -1, 2 * dk + 2 * rv)
            q, k, v, z = torch.split(qkvz, [dk, dk, rv, rv], dim=-1)
            b, a = torch.split(self.in_proj_ba(x).reshape(bsz * seq, -1, 2 * r), [r, r], dim=-1)
            qkv = torch.cat([t.reshape(bsz, seq, -1) for t in (q, k, v)], dim=-1)
            return (
                qkv,
                z.reshape(bsz, seq, -1, self.head_v_dim),
                b.reshape(bsz, seq, -1),
                a.reshape(bsz, seq, -1),
            )
        assert self.in_proj_qkv is not None and self.in_proj_z is not None
        assert self.in_proj_b is not None and self.in_proj_a is not None
        z = self.in_proj_z(x).reshape(bsz, seq, -1, self.head_v_dim)
        return self.in_proj_qkv(x), z, self.in_proj_b(x), self.in_proj_a(x)

    def _decay_and_beta(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``g = -exp(A_log) * softplus(a + dt_bias)`` (fp32) and ``beta = sigmoid(b)``, ``[B, S, Hv]``.

        Computed on heads-first copies (``[B, Hv, S]``, the delta rule's layout) and returned as
        transposed views: their gradients then arrive contiguous, so every elementwise backward
        sees one layout (compiled graphs plan the strides of ``softplus_backward`` with mixed
        layouts differently from eager, and a planned ``view`` then fails).
        """
        a_h = a.float().transpose(1, 2).contiguous()
        b_h = b.transpose(1, 2).contiguous()
        g = -self.A_log.float().exp().unsqueeze(-1) * F.softplus(a_h + self.dt_bias.unsqueeze(-1))
        return g.transpose(1, 2), b_h.sigmoid().transpose(1, 2)

    def _resolve_fla(self) -> FlaKernels | None:
        """fla's kernels when this layer runs them on CUDA (decided and imported once, when it is built,
        outside any compiled region): ``fla`` needs them usable (else an error naming why), ``auto`` takes
        them when usable (else one log note and the PyTorch path), ``torch`` and CPU-only machines never."""
        if self.implementation == "torch" or not torch.cuda.is_available():
            return None
        reason = fla_unusable()
        if reason is None:
            return fla_kernels()
        if self.implementation == "fla":
            raise ImportError(f"linear_attn_implementation='fla': {reason}")
        if self.layer_idx == 0:
            log.warning("linear_attn_implementation='auto': the PyTorch gated delta rule, since %s", reason)
        return None

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: AttentionMask
    ) -> torch.Tensor:
        """``x [B, S, H]`` -> ``[B, S, H]`` (``rope`` is not used: positions come from the recurrence)."""
        del rope
        if mask.context is not None:
            raise ValueError(
                f"context parallelism is not supported by layer {self.layer_idx} (layer type "
                "'linear_attention', a gated DeltaNet: its recurrent state crosses the sequence shards)"
            )
        bsz, seq, _ = x.shape
        if mask.padding_mask is not None:  # padding tokens write nothing (transformers zeroes them too)
            x = x * mask.padding_mask.unsqueeze(-1).to(x.dtype)
        docs = mask.document_ids
        qkv, z, b, a = self._project(x)
        weight = self.conv1d.weight.squeeze(1)
        kernels = self.fla if x.device.type == "cuda" else None
        if kernels is not None:
            qkv = fla_causal_conv1d(qkv, weight, docs, kernels=kernels)
        else:
            qkv = F.silu(causal_conv1d(qkv, weight, docs))
        q, k, v = torch.split(qkv, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(bsz, seq, -1, self.head_k_dim)
        k = k.reshape(bsz, seq, -1, self.head_k_dim)
        v = v.reshape(bsz, seq, -1, self.head_v_dim)
        g, beta = self._decay_and_beta(a, b)
        if kernels is not None:
            o = fla_gated_delta_rule(q, k, v, g, beta, document_ids=docs, kernels=kernels)
        else:
            o = chunk_gated_delta_rule(q, k, v, g, beta, document_ids=docs, chunk_size=self.chunk_size)
        o = self.norm(o, z)
        return self.out_proj(o.reshape(bsz, seq, -1))

    def reset_parameters(self, std: float) -> None:
        """Hugging Face's init: normal(0, std) projections, the convolution's default init,
        ``dt_bias = 1``, ``A_log = log(uniform(0.01, 16))``, unit norm."""
        for lin in (self.in_proj_qkvz, self.in_proj_ba, self.in_proj_qkv, self.in_proj_z, self.in_proj_b,
                    self.in_proj_a, self.out_proj):  # fmt: skip
            if lin is not None:
                nn.init.normal_(lin.weight, 0.0, std)
        self.conv1d.reset_parameters()
        with torch.no_grad():
            nn.init.ones_(self.dt_bias)
            self.A_log.copy_(torch.empty_like(self.A_log).uniform_(0.01, 16).log_())
        self.norm.reset_parameters()
