"""Multi-head latent attention (MLA), as transformers' ``DeepseekV3Attention`` computes it."""

from __future__ import annotations

import math
from typing import Literal, cast, get_args

import torch
import torch.distributed as dist
import torch.nn.functional as F
from plait.models.common._comm import all_reduce_backward
from plait.models.common.attention import AttentionMask, allgather_latent_attention
from plait.models.common.attention.core import attention
from plait.models.common.config import RopeParameters
from plait.models.common.norm import RMSNorm
from plait.models.common.rope import apply_rotary
from plait.models.deepseek_v3.config import DeepseekV3Config
from torch import nn

__all__ = ["ContextGather", "MultiHeadLatentAttention", "mla_softmax_scale"]

ContextGather = Literal["latent", "expanded"]

# transformers builds q_a_layernorm / kv_a_layernorm with the RMSNorm default, not rms_norm_eps.
_LATENT_NORM_EPS = 1e-6


def _yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def mla_softmax_scale(qk_head_dim: int, rope: RopeParameters, max_position_embeddings: int) -> float:
    """``qk_head_dim ** -0.5``, times ``mscale(factor, mscale_all_dim) ** 2`` for a scaled RoPE with
    ``mscale_all_dim`` set (DeepSeek's YaRN softmax correction, as transformers applies it)."""
    scale = qk_head_dim**-0.5
    if rope.rope_type != "default" and rope.mscale_all_dim:
        factor = rope.factor
        if factor is None:  # YaRN's default factor
            assert rope.original_max_position_embeddings is not None
            factor = max_position_embeddings / rope.original_max_position_embeddings
        m = _yarn_mscale(factor, rope.mscale_all_dim)
        scale = scale * m * m
    return scale


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    """``(x0, x1), (x2, x3), ...`` pairs -> ``x0, x2, ..., x1, x3, ...`` (the half-split layout)."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


def _pad(x: torch.Tensor, d: int) -> torch.Tensor:
    """``x`` zero-padded to head size ``d`` (kernels that need one head size for q, k and v:
    FlashAttention's; context parallelism's, which move k and v in one buffer). Zero columns add
    nothing to a score or to an output column; the output is cut back to v's width."""
    return x if x.shape[-1] == d else F.pad(x, (0, d - x.shape[-1]))


class MultiHeadLatentAttention(nn.Module):
    """DeepSeek-V2/V3 multi-head latent attention (parameter names as in transformers).

    ``q = q_b_proj(q_a_layernorm(q_a_proj(x)))`` (or ``q_proj(x)`` without ``q_lora_rank``), split
    per head into ``qk_nope_head_dim`` + ``qk_rope_head_dim``; ``kv_a_proj_with_mqa(x)`` gives the
    latent ``c_kv`` (``kv_lora_rank``) and one rope key shared by all heads; ``kv_b_proj`` expands
    ``kv_a_layernorm(c_kv)`` into per-head ``k_nope`` and ``v`` (``v_head_dim``). RoPE rotates the
    rope parts (interleaved pairs with ``rope_interleave``); attention runs on the trunk's kernels
    with v's head size != q/k's (SDPA, FlexAttention; for FlashAttention and under context
    parallelism, whose kernels need one head size, the narrower of q/k and v is zero-padded);
    ``o_proj`` maps ``heads * v_head_dim`` back.

    Context parallelism in the all-gather mode moves the latent (``kv_a_layernorm(c_kv)`` and the
    rope key after RoPE at the global positions, ``kv_lora_rank + qk_rope_head_dim`` values a token)
    and every rank expands the whole sequence with ``kv_b_proj``
    (:func:`plait.models.common.attention.allgather_latent_attention`); ``context_gather =
    "expanded"`` gathers the expanded keys and values instead (``2 * heads * max(qk_head_dim,
    v_head_dim)`` values a token), as the ring mode moves them.

    Under tensor parallelism the heads are sharded (``q_b_proj`` / ``q_proj`` and ``kv_b_proj``
    column-parallel, ``o_proj`` row-parallel) and the latent path is replicated; every local head
    reads the one rope key, so its gradient is summed over ``tp_group`` (set by the plan).

    Args:
        config: The DeepSeek-V3 config.

    Attributes:
        tp_group: The tensor-parallel group (None without tensor parallelism).
    """

    sliding_window: int | None = None
    has_sinks: bool = False

    def __init__(self, config: DeepseekV3Config) -> None:
        super().__init__()
        h, heads = config.hidden_size, config.num_attention_heads
        self.qk_nope_head_dim = config.qk_nope_head_dim
        self.qk_rope_head_dim = config.qk_rope_head_dim
        self.qk_head_dim = config.qk_head_dim
        self.v_head_dim = config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.rope_interleave = config.rope_interleave
        bias = config.attention_bias
        self.q_proj: nn.Linear | None = None
        self.q_a_proj: nn.Linear | None = None
        self.q_a_layernorm: RMSNorm | None = None
        self.q_b_proj: nn.Linear | None = None
        if config.q_lora_rank is None:
            self.q_proj = nn.Linear(h, heads * self.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(h, config.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, _LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(config.q_lora_rank, heads * self.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, self.kv_lora_rank + self.qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, _LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(
            self.kv_lora_rank, heads * (self.qk_nope_head_dim + self.v_head_dim), bias=False
        )
        self.o_proj = nn.Linear(heads * self.v_head_dim, h, bias=bias)
        self.scaling = mla_softmax_scale(
            self.qk_head_dim, config.rope_parameters, config.max_position_embeddings
        )
        self._context_gather: ContextGather = "latent"
        self.tp_group: dist.ProcessGroup | None = None

    @property
    def context_gather(self) -> ContextGather:
        """What the all-gather context parallelism moves: ``"latent"`` (default) or ``"expanded"``
        (the keys and values).

        Raises:
            ValueError: on setting another value.
        """
        return self._context_gather

    @context_gather.setter
    def context_gather(self, value: str) -> None:
        if value not in get_args(ContextGather):
            raise ValueError(
                f"MultiHeadLatentAttention.context_gather must be 'latent' or 'expanded', got {value!r}"
            )
        self._context_gather = cast(ContextGather, value)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: AttentionMask
    ) -> torch.Tensor:
        """``x [B, S, H]`` -> ``[B, S, H]``."""
        b, s, _ = x.shape
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            assert self.q_a_proj is not None and self.q_a_layernorm is not None and self.q_b_proj is not None
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(b, s, -1, self.qk_head_dim)
        q_nope, q_rot = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        c_kv, k_rot = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        k_rot = all_reduce_backward(k_rot, self.tp_group).view(b, s, 1, self.qk_rope_head_dim)
        if self.rope_interleave:
            q_rot, k_rot = _deinterleave(q_rot), _deinterleave(k_rot)
        q_rot, k_rot = apply_rotary(q_rot, k_rot, *rope)
        q = torch.cat((q_nope, q_rot), dim=-1)
        c_kv = self.kv_a_layernorm(c_kv)
        cp, dv = mask.context, self.v_head_dim
        if cp is not None and cp.mode == "allgather" and self.context_gather == "latent":
            latent = torch.cat((c_kv, k_rot.flatten(2)), dim=-1)
            d = max(self.qk_head_dim, dv)
            out = allgather_latent_attention(_pad(q, d), latent, self._expand_latent, mask, self.scaling, cp)
            out = out[..., :dv]
        else:
            k, v = self._expand(c_kv, k_rot)
            if (cp is not None or mask.backend == "flash") and dv != self.qk_head_dim:
                d = max(self.qk_head_dim, dv)
                out = attention(_pad(q, d), _pad(k, d), _pad(v, d), mask, self.scaling)[..., :dv]
            else:
                out = attention(q, k, v, mask, self.scaling)
        return self.o_proj(out.reshape(b, s, -1))

    def _expand(self, c_kv: torch.Tensor, k_rot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Normed latent ``[B, T, kv_lora_rank]`` and rope key ``[B, T, 1, rope]`` -> per-head
        ``k [B, T, heads, qk_head_dim]``, ``v [B, T, heads, v_head_dim]``."""
        b, t, _ = c_kv.shape
        kv = self.kv_b_proj(c_kv).view(b, t, -1, self.qk_nope_head_dim + self.v_head_dim)
        k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        return torch.cat((k_nope, k_rot.expand(-1, -1, k_nope.shape[2], -1)), dim=-1), v

    def _expand_latent(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Gathered ``[B, T, kv_lora_rank + rope]`` -> ``k, v`` padded to one head size."""
        c_kv, k_rot = latent.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        k, v = self._expand(c_kv, k_rot.unsqueeze(2))
        d = max(self.qk_head_dim, self.v_head_dim)
        return _pad(k, d), _pad(v, d)

    def reset_parameters(self, std: float) -> None:
        """Normal(0, std) projections, zero biases, unit norms."""
        for lin in (
            self.q_proj,
            self.q_a_proj,
            self.q_b_proj,
            self.kv_a_proj_with_mqa,
            self.kv_b_proj,
            self.o_proj,
        ):
            if lin is None:
                continue
            nn.init.normal_(lin.weight, 0.0, std)
            if lin.bias is not None:
                nn.init.zeros_(lin.bias)
        for norm in (self.q_a_layernorm, self.kv_a_layernorm):
            if norm is not None:
                norm.reset_parameters()
