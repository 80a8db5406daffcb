"""Grouped-query attention with q/k RMSNorm and pluggable kernels (SDPA, FlexAttention, FlashAttention).

Packed sequences are handled through *document ids*: token ``t`` of row ``b`` may attend to token
``s <= t`` only when both carry the same document id. :func:`build_attention_mask` turns document
ids (or position ids that restart at 0 per document) into what the chosen backend needs, once per
forward, and every layer reuses it. Padding (a transformers-style ``attention_mask``, 0 = padding,
left or right) is one more document rule: every padding token is a document of its own, so real
tokens never attend to padding and a padding token attends only to itself (no empty softmax row).
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.nn.functional as F
from plait.models.blocks.norm import RMSNorm
from plait.models.blocks.rope import apply_rotary
from torch import nn

if TYPE_CHECKING:
    from plait.models.blocks.context_parallel import ContextParallelMask

__all__ = [
    "AttentionMask",
    "GroupedQueryAttention",
    "build_attention_mask",
    "document_ids_from_position_ids",
    "flash_attn_available",
]

Backend = Literal["sdpa", "flex", "flash"]


def flash_attn_available() -> bool:
    """Whether the ``flash_attn`` package is importable (it is imported lazily, only when used)."""
    return importlib.util.find_spec("flash_attn") is not None


def document_ids_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Document ids ``[B, S]`` from position ids that restart (at a value <= the previous) per document."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] <= position_ids[:, :-1]
    return torch.cumsum(starts.to(torch.int32), dim=1)


@dataclass(frozen=True)
class AttentionMask:
    """What one forward's attention layers need to mask; built by :func:`build_attention_mask`.

    Attributes:
        backend: Kernel family that consumes this mask.
        document_ids: ``[B, S]`` document ids for packed rows, or None for plain causal attention.
        dense_mask: SDPA boolean mask ``[B, 1, S, S]`` (True = attend) for packed rows.
        block_mask: FlexAttention ``BlockMask`` for packed rows.
        cu_seqlens: FlashAttention varlen cumulative lengths (int32) over the flattened batch.
        max_seqlen: Longest document (FlashAttention varlen).
        context: Context parallelism: the sequence is sharded over a group and attention crosses
            ranks (see :mod:`plait.models.blocks.context_parallel`).
        padding_mask: ``[B, S]`` bool, False = padding token (None: no padding); MoE layers leave
            padding out of their balancing losses.
    """

    backend: Backend
    document_ids: torch.Tensor | None = None
    dense_mask: torch.Tensor | None = None
    block_mask: Any = None
    cu_seqlens: torch.Tensor | None = None
    max_seqlen: int = 0
    context: ContextParallelMask | None = None
    padding_mask: torch.Tensor | None = None


def _resolve_backend(requested: str, device: torch.device, dtype: torch.dtype, packed: bool) -> Backend:
    if requested == "flash":
        if not flash_attn_available():
            raise ImportError(
                "attn_implementation='flash' needs flash-attn: pip install 'plait-models[flash]'"
            )
        return "flash"
    if requested in ("sdpa", "flex"):
        return requested  # type: ignore[return-value]
    if requested != "auto":
        raise ValueError(f"attn_implementation must be auto|sdpa|flex|flash, got {requested!r}")
    on_gpu_half = device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)
    if on_gpu_half and flash_attn_available():
        return "flash"
    if packed and device.type == "cuda":
        return "flex"
    return "sdpa"


def build_attention_mask(
    batch: int,
    seq_len: int,
    device: torch.device,
    dtype: torch.dtype,
    *,
    document_ids: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    implementation: str = "auto",
) -> AttentionMask:
    """Build the causal (optionally document, optionally padding) mask for one forward.

    Args:
        batch: Batch size.
        seq_len: Sequence length.
        device: Device of the activations.
        dtype: Activation dtype (FlashAttention needs fp16/bf16).
        document_ids: ``[B, S]`` int ids; tokens attend only within their document.
        position_ids: If given without ``document_ids`` and they restart inside a row, documents
            are derived from the restarts (packed sequences).
        attention_mask: ``[B, S]`` padding mask with transformers' meaning (1 = token, 0 = padding,
            anywhere in the row); an all-ones mask is the same as none.
        implementation: ``auto``, ``sdpa``, ``flex`` or ``flash``.

    Returns:
        An :class:`AttentionMask` for :class:`GroupedQueryAttention`.
    """
    if document_ids is None and position_ids is not None and seq_len > 1:
        pos = position_ids.expand(batch, seq_len) if position_ids.shape[0] == 1 else position_ids
        if bool((pos[:, 1:] <= pos[:, :-1]).any()):
            document_ids = document_ids_from_position_ids(pos)
    if document_ids is not None and tuple(document_ids.shape) != (batch, seq_len):
        raise ValueError(f"document_ids must have shape {(batch, seq_len)}, got {tuple(document_ids.shape)}")
    padding = _padding_mask(attention_mask, batch, seq_len, device)
    if padding is not None:
        document_ids = _isolate_padding(document_ids, padding)
    packed = document_ids is not None
    backend = _resolve_backend(implementation, device, dtype, packed)
    if not packed:
        return AttentionMask(backend=backend)
    assert document_ids is not None
    if backend == "sdpa":
        same = document_ids[:, :, None] == document_ids[:, None, :]
        causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()
        return AttentionMask(backend, document_ids, dense_mask=(same & causal)[:, None], padding_mask=padding)
    if backend == "flex":
        docs = document_ids

        def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            return (q_idx >= kv_idx) & (docs[b, q_idx] == docs[b, kv_idx])

        block_mask = flex_block_mask(mask_mod, batch, seq_len, seq_len, device)
        return AttentionMask(backend, document_ids, block_mask=block_mask, padding_mask=padding)
    # flash varlen over the flattened batch: a new sequence starts at every document change or row start.
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    idx = torch.nonzero(starts.flatten()).flatten().to(torch.int32)
    total = torch.tensor([batch * seq_len], dtype=torch.int32, device=device)
    cu = torch.cat([idx, total])
    max_len = int((cu[1:] - cu[:-1]).max().item())
    return AttentionMask(backend, document_ids, cu_seqlens=cu, max_seqlen=max_len, padding_mask=padding)


def _padding_mask(
    attention_mask: torch.Tensor | None, batch: int, seq_len: int, device: torch.device
) -> torch.Tensor | None:
    """``attention_mask`` as bool ``[B, S]``, or None when there is no padding (plain causal kernels)."""
    if attention_mask is None:
        return None
    if tuple(attention_mask.shape) != (batch, seq_len):
        raise ValueError(
            f"attention_mask must have shape {(batch, seq_len)} (1 = token, 0 = padding), "
            f"got {tuple(attention_mask.shape)}"
        )
    padding = attention_mask.to(device=device, dtype=torch.bool)
    # One host sync, like the position_ids check above (and transformers' own): no padding keeps
    # the unmasked kernels.
    return None if bool(padding.all()) else padding


def _isolate_padding(document_ids: torch.Tensor | None, padding: torch.Tensor) -> torch.Tensor:
    """Document ids where each padding token is a document of its own (an id no other token has)."""
    docs = (
        torch.zeros_like(padding, dtype=torch.int64)
        if document_ids is None
        else document_ids.to(padding.device, torch.int64)
    )
    own = docs.max() + 1 + torch.arange(padding.shape[1], device=padding.device)
    return torch.where(padding, docs, own)


_FLEX_COMPILED: Any = None
_BLOCK_MASK_COMPILED: Any = None


def flex_block_mask(mask_mod: Any, batch: int, q_len: int, kv_len: int, device: torch.device) -> Any:
    """FlexAttention ``BlockMask`` of ``mask_mod`` for ``[batch, q_len]`` queries and ``kv_len`` keys.

    On CUDA ``create_block_mask`` runs compiled (once per process, as torch recommends): it then
    evaluates the mask block by block, while the eager version materialises the dense
    ``[batch, q_len, kv_len]`` mask and its intermediates, whose memory grows with the square of the
    sequence (tens of GiB at 128k tokens).
    """
    global _BLOCK_MASK_COMPILED
    from torch.nn.attention.flex_attention import create_block_mask

    fn: Any = create_block_mask
    if device.type == "cuda" and not torch.compiler.is_compiling():
        if _BLOCK_MASK_COMPILED is None:
            _BLOCK_MASK_COMPILED = torch.compile(create_block_mask)
        fn = _BLOCK_MASK_COMPILED
    return fn(mask_mod, batch, None, q_len, kv_len, device=device)


def _flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: Any, scale: float) -> torch.Tensor:
    global _FLEX_COMPILED
    from torch.nn.attention.flex_attention import flex_attention

    fn: Any = flex_attention
    if q.device.type == "cuda" and not torch.compiler.is_compiling():
        # FlexAttention is only fast compiled; eager callers get a compiled copy (once per process).
        # Inside a compiled region (a compiled decoder layer) the call is traced into that graph,
        # document mask included, so no nested compile and no graph break.
        if _FLEX_COMPILED is None:
            _FLEX_COMPILED = torch.compile(flex_attention, dynamic=False)
        fn = _FLEX_COMPILED
    return fn(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


def _flash(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask, scale: float
) -> torch.Tensor:
    """q, k, v: ``[B, S, heads, D]``; returns ``[B, S, heads, D]``."""
    flash_attn = importlib.import_module("flash_attn")
    if mask.cu_seqlens is None:
        return flash_attn.flash_attn_func(q, k, v, softmax_scale=scale, causal=True)
    b, s = q.shape[:2]
    out = flash_attn.flash_attn_varlen_func(
        q.reshape(b * s, *q.shape[2:]),
        k.reshape(b * s, *k.shape[2:]),
        v.reshape(b * s, *v.shape[2:]),
        mask.cu_seqlens,
        mask.cu_seqlens,
        mask.max_seqlen,
        mask.max_seqlen,
        softmax_scale=scale,
        causal=True,
    )
    return out.reshape(b, s, *out.shape[1:])


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask, scale: float
) -> torch.Tensor:
    """Causal (document-masked) attention of ``[B, S, heads, D]`` tensors (k/v may have fewer heads).

    Returns ``[B, S, q_heads, D]``.
    """
    if mask.context is not None:
        return mask.context.attend(q, k, v, mask, scale)
    if mask.backend == "flash":
        return _flash(q, k, v, mask, scale)
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    gqa = qt.shape[1] != kt.shape[1]
    if mask.backend == "flex" and mask.block_mask is not None:
        out = _flex(qt, kt, vt, mask.block_mask, scale)
    elif mask.dense_mask is not None:
        out = F.scaled_dot_product_attention(
            qt, kt, vt, attn_mask=mask.dense_mask, scale=scale, enable_gqa=gqa
        )
    else:
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=gqa)
    return out.transpose(1, 2)


class GroupedQueryAttention(nn.Module):
    """Qwen3 attention: q/k/v projections, per-head RMSNorm on q and k, RoPE, causal attention, o_proj.

    Under tensor parallelism q/k/v are column-parallel and o is row-parallel: the local head count
    is read from the projection outputs, so the same forward serves sharded and unsharded modules.

    Args:
        hidden_size: Model width.
        num_heads: Query heads.
        num_kv_heads: Key/value heads.
        head_dim: Per-head width.
        bias: Bias on the projections.
        eps: RMSNorm epsilon of q_norm/k_norm.
    """

    def __init__(
        self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool, eps: float
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scaling = head_dim**-0.5
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=bias)
        self.q_norm = RMSNorm(head_dim, eps)
        self.k_norm = RMSNorm(head_dim, eps)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: AttentionMask
    ) -> torch.Tensor:
        """``x [B, S, H]`` -> ``[B, S, H]``."""
        b, s, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, s, -1, self.head_dim))
        k = self.k_norm(self.k_proj(x).view(b, s, -1, self.head_dim))
        v = self.v_proj(x).view(b, s, -1, self.head_dim)
        q, k = apply_rotary(q, k, *rope)
        out = attention(q, k, v, mask, self.scaling)
        return self.o_proj(out.reshape(b, s, -1))

    def reset_parameters(self, std: float) -> None:
        """Normal(0, std) projections, zero biases, unit norms."""
        for lin in (self.q_proj, self.k_proj, self.v_proj, self.o_proj):
            nn.init.normal_(lin.weight, 0.0, std)
            if lin.bias is not None:
                nn.init.zeros_(lin.bias)
        self.q_norm.reset_parameters()
        self.k_norm.reset_parameters()
