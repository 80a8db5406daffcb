"""Attention kernels: SDPA, FlexAttention (compiled once per model), FlashAttention, and the
PyTorch reference used for attention sinks on CPU.

Attention sinks (gpt-oss) add one learned logit per head to every softmax denominator:
``p_j = exp(s_j) / (sum_i exp(s_i) + exp(sink))``. With the log-sum-exp of the scores,
``out_sink = out * sigmoid(lse - sink)``, which FlexAttention computes exactly (its log-sum-exp is
differentiable); on CPU the sink is a softmax column, as transformers' eager path computes it.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

import torch
import torch.nn.functional as F

__all__ = [
    "AttentionKernels",
    "apply_sinks",
    "flash_attn_available",
    "masked_attention",
    "sink_reference_attention",
]


def flash_attn_available() -> bool:
    """Whether the ``flash_attn`` package is importable (it is imported lazily, only when used)."""
    return importlib.util.find_spec("flash_attn") is not None


class AttentionKernels:
    """The compiled FlexAttention callables of one model (compiled on first CUDA use).

    FlexAttention is only fast compiled, and ``create_block_mask`` compiled evaluates the mask block
    by block instead of materialising the dense ``[B, q_len, kv_len]`` mask (tens of GiB at 128k
    tokens). Inside a compiled region (a compiled decoder layer) the eager functions are traced into
    that graph instead: no nested compile, no graph break.

    Attributes:
        static_captures: The decoder layers replay CUDA graphs (set by :func:`plait.models.parallelize`
            with ``ParallelConfig.cuda_graphs``): the masks' tensors are kept at one address per shape
            (:meth:`captured`).
    """

    def __init__(self) -> None:
        self._flex: Any = None
        self._block_mask: Any = None
        self.static_captures = False
        self._captured: dict[tuple[Any, ...], torch.Tensor] = {}

    def captured(self, t: torch.Tensor, name: str) -> torch.Tensor:
        """``t`` itself, or with ``static_captures`` its values in a buffer kept for ``name``, its shape,
        dtype and device.

        A compiled layer takes the tensors of its mask (the block mask's, and the document ids its mask
        function closes over) as graph inputs, some as static ones: under CUDA graphs a new address each
        forward would record every layer's graphs again (a device sync and new graph memory per layer and
        forward). The buffer is rewritten by the next forward of that shape, so a forward's backward must
        run before it, as with one stage per process, the only layout ``cuda_graphs`` allows.
        """
        if not self.static_captures:
            return t
        key = (name, tuple(t.shape), t.dtype, t.device)
        buf = self._captured.get(key)
        if buf is None:
            buf = self._captured[key] = torch.empty_like(t)
        return buf.copy_(t)

    def block_mask(
        self, mask_mod: Any, batch: int, q_len: int, kv_len: int, device: torch.device, name: str = "mask"
    ) -> Any:
        """FlexAttention ``BlockMask`` of ``mask_mod`` for ``[batch, q_len]`` queries and ``kv_len`` keys;
        ``name`` tells apart the masks of one forward (their :meth:`captured` buffers)."""
        from torch.nn.attention.flex_attention import create_block_mask

        fn: Any = create_block_mask
        if device.type == "cuda" and not torch.compiler.is_compiling():
            if self._block_mask is None:
                self._block_mask = torch.compile(create_block_mask)
            fn = self._block_mask
        mask = fn(mask_mod, batch, None, q_len, kv_len, device=device)
        if self.static_captures:
            for attr, t in list(vars(mask).items()):
                if isinstance(t, torch.Tensor):
                    setattr(mask, attr, self.captured(t, f"{name}.{attr}"))
        return mask

    def flex(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        block_mask: Any,
        scale: float,
        return_lse: bool = False,
    ) -> Any:
        """FlexAttention of ``[B, H, L, D]`` tensors; ``(out, lse)`` with ``return_lse``.

        On CUDA, head sizes below the kernel's minimum (``FLEX_MIN_HEAD_DIM``) are zero-padded (exact:
        zero columns add nothing to ``q @ k.T``; v's padded columns are cut from the output).
        """
        from torch.nn.attention.flex_attention import flex_attention

        fn: Any = flex_attention
        if q.device.type == "cuda" and not torch.compiler.is_compiling():
            if self._flex is None:
                self._flex = torch.compile(flex_attention, dynamic=False)
            fn = self._flex
        dv = v.shape[-1]
        if q.device.type == "cuda":
            q, k = _pad_head_dim(q, FLEX_MIN_HEAD_DIM), _pad_head_dim(k, FLEX_MIN_HEAD_DIM)
            v = _pad_head_dim(v, FLEX_MIN_HEAD_DIM)
        gqa = q.shape[1] != k.shape[1]
        res = fn(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa, return_lse=return_lse)
        if v.shape[-1] == dv:
            return res
        return (res[0][..., :dv], res[1]) if return_lse else res[..., :dv]


FLEX_MIN_HEAD_DIM = 16  # FlexAttention's CUDA kernel refuses smaller q/k and v head sizes


def _pad_head_dim(x: torch.Tensor, size: int) -> torch.Tensor:
    return x if x.shape[-1] >= size else F.pad(x, (0, size - x.shape[-1]))


def apply_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """``out [B, H, L, D]`` scaled by ``sigmoid(lse - sink)``: the softmax with one more, sink, logit."""
    acc = torch.promote_types(out.dtype, torch.float32)  # fp32 for half inputs, fp64 stays fp64
    w = torch.sigmoid(lse.to(acc) - sinks.to(acc).view(1, -1, 1))
    return (out.to(acc) * w[..., None]).to(out.dtype)


def sink_reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Causal attention in plain PyTorch with an optional sink logit per head (``[B, H, L, D]`` in/out).

    ``mask``: boolean ``[B|1, 1, L, L]`` (True = attend), or None for plain causal attention.
    """
    b, hq, s, _ = q.shape
    if k.shape[1] != hq:
        rep = hq // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if mask is None:
        mask = torch.ones(s, k.shape[2], dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.matmul(torch.softmax(scores.float(), dim=-1).to(v.dtype), v)
    sink = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(b, hq, s, 1)
    logits = torch.cat([scores, sink], dim=-1)
    logits = logits - logits.amax(dim=-1, keepdim=True)
    probs = F.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1]
    return torch.matmul(probs.to(v.dtype), v)


def masked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    *,
    kernels: AttentionKernels,
    block_mask: Any = None,
    dense_mask: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ``[B, H, L, D]`` tensors under a FlexAttention ``block_mask``, else an SDPA boolean
    ``dense_mask`` (None: causal), with optional sink logits per query head."""
    if block_mask is not None:
        if sinks is None:
            return kernels.flex(q, k, v, block_mask, scale)  # type: ignore[no-any-return]
        out, lse = kernels.flex(q, k, v, block_mask, scale, return_lse=True)
        return apply_sinks(out, lse, sinks)
    if sinks is not None:
        return sink_reference_attention(q, k, v, dense_mask, scale, sinks)
    gqa = q.shape[1] != k.shape[1]
    if dense_mask is not None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=dense_mask, scale=scale, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)


def flash(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    cu_seqlens: torch.Tensor | None,
    max_seqlen: int,
    window: int | None,
) -> torch.Tensor:
    """FlashAttention of ``[B, S, heads, D]`` tensors (varlen with ``cu_seqlens``); same layout out."""
    flash_attn = importlib.import_module("flash_attn")
    window_size = (-1, -1) if window is None else (window - 1, 0)
    if cu_seqlens is None:
        return flash_attn.flash_attn_func(  # type: ignore[no-any-return]
            q, k, v, softmax_scale=scale, causal=True, window_size=window_size
        )
    b, s = q.shape[:2]
    out = flash_attn.flash_attn_varlen_func(
        q.reshape(b * s, *q.shape[2:]),
        k.reshape(b * s, *k.shape[2:]),
        v.reshape(b * s, *v.shape[2:]),
        cu_seqlens,
        cu_seqlens,
        max_seqlen,
        max_seqlen,
        softmax_scale=scale,
        causal=True,
        window_size=window_size,
    )
    return out.reshape(b, s, *out.shape[1:])  # type: ignore[no-any-return]
