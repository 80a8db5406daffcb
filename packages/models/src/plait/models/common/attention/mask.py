"""Attention masks: causal, per document (packed rows), padding, sliding window.

Packed sequences are handled through *document ids*: token ``t`` of row ``b`` may attend to token
``s <= t`` only when both carry the same document id. :func:`build_attention_mask` turns document
ids (or position ids that restart at 0 per document) into what the chosen backend needs, once per
forward, and every layer reuses it. Padding (a transformers-style ``attention_mask``, 0 = padding,
left or right) is one more document rule: every padding token is a document of its own, so real
tokens never attend to padding and a padding token attends only to itself (no empty softmax row).
A sliding window of ``w`` (transformers' meaning) lets token ``t`` see keys ``s`` with ``t - s < w``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
from plait.models.common.attention.kernels import AttentionKernels, flash_attn_available

if TYPE_CHECKING:
    from plait.models.common.attention.context import ContextParallelMask

__all__ = [
    "AttentionMask",
    "Backend",
    "build_attention_mask",
    "document_ids_from_position_ids",
    "isolate_padding",
    "padding_mask",
]

Backend = Literal["sdpa", "flex", "flash"]


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
        kernels: The compiled kernels of the model that built the mask (FlexAttention).
        document_ids: ``[B, S]`` document ids for packed rows, or None for plain causal attention.
        dense_mask: SDPA boolean mask ``[B|1, 1, S, S]`` (True = attend) for packed rows or a window.
        block_mask: FlexAttention ``BlockMask``.
        cu_seqlens: FlashAttention varlen cumulative lengths (int32) over the flattened batch.
        max_seqlen: Longest document (FlashAttention varlen).
        sliding_window: Keys visible to a query (itself included), or None for full causal attention.
        context: Context parallelism: the sequence is sharded over a group and attention crosses
            ranks (see :mod:`plait.models.common.attention.context`).
        padding_mask: ``[B, S]`` bool, False = padding token (None: no padding); MoE layers leave
            padding out of their balancing losses.
    """

    backend: Backend
    kernels: AttentionKernels
    document_ids: torch.Tensor | None = None
    dense_mask: torch.Tensor | None = None
    block_mask: Any = None
    cu_seqlens: torch.Tensor | None = None
    max_seqlen: int = 0
    sliding_window: int | None = None
    context: ContextParallelMask | None = None
    padding_mask: torch.Tensor | None = None


def resolve_backend(
    requested: str, device: torch.device, dtype: torch.dtype, packed: bool, windowed: bool = False
) -> Backend:
    """The kernel family for ``attn_implementation=requested`` and these inputs."""
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
    if (packed or windowed) and device.type == "cuda":
        return "flex"
    return "sdpa"


def build_attention_mask(
    batch: int,
    seq_len: int,
    device: torch.device,
    dtype: torch.dtype,
    *,
    kernels: AttentionKernels | None = None,
    document_ids: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    implementation: str = "auto",
    sliding_window: int | None = None,
    sinks: bool = False,
) -> AttentionMask:
    """Build the causal (optionally document, padding and sliding-window) mask for one forward.

    Args:
        batch: Batch size.
        seq_len: Sequence length.
        device: Device of the activations.
        dtype: Activation dtype (FlashAttention needs fp16/bf16).
        kernels: The model's compiled-kernel cache (a new one if None).
        document_ids: ``[B, S]`` int ids; tokens attend only within their document.
        position_ids: If given without ``document_ids`` and they restart inside a row, documents
            are derived from the restarts (packed sequences).
        attention_mask: ``[B, S]`` padding mask with transformers' meaning (1 = token, 0 = padding,
            anywhere in the row); an all-ones mask is the same as none.
        implementation: ``auto``, ``sdpa``, ``flex`` or ``flash``.
        sliding_window: Keys a query sees (itself included); None = full causal attention.
        sinks: The layers have attention sinks: on CUDA they need FlexAttention (its log-sum-exp).

    Returns:
        An :class:`AttentionMask` for :func:`plait.models.common.attention.attention`.
    """
    if document_ids is None and position_ids is not None and seq_len > 1:
        pos = position_ids.expand(batch, seq_len) if position_ids.shape[0] == 1 else position_ids
        if bool((pos[:, 1:] <= pos[:, :-1]).any()):
            document_ids = document_ids_from_position_ids(pos)
    if document_ids is not None and tuple(document_ids.shape) != (batch, seq_len):
        raise ValueError(f"document_ids must have shape {(batch, seq_len)}, got {tuple(document_ids.shape)}")
    padding = padding_mask(attention_mask, batch, seq_len, device)
    if padding is not None:
        document_ids = isolate_padding(document_ids, padding)
    packed = document_ids is not None
    window = sliding_window if sliding_window is not None and sliding_window < seq_len else None
    backend = resolve_backend(implementation, device, dtype, packed, window is not None or sinks)
    if sinks and backend == "flash":
        raise ValueError(
            "attn_implementation='flash' has no attention sinks; use 'auto' or 'flex' for this model"
        )
    kernels = kernels or AttentionKernels()
    common: dict[str, Any] = {"kernels": kernels, "padding_mask": padding, "sliding_window": window}
    if not packed and window is None and backend != "flex":
        return AttentionMask(backend, **common)
    if backend == "sdpa":
        q_idx = torch.arange(seq_len, device=device)
        dense = q_idx[:, None] >= q_idx[None, :]
        if window is not None:
            dense = dense & (q_idx[:, None] - q_idx[None, :] < window)
        dense = dense[None]
        if document_ids is not None:
            dense = dense & (document_ids[:, :, None] == document_ids[:, None, :])
        return AttentionMask(backend, document_ids=document_ids, dense_mask=dense[:, None], **common)
    if backend == "flex":
        docs = None if document_ids is None else kernels.captured(document_ids, "document_ids")

        def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            keep = q_idx >= kv_idx
            if window is not None:
                keep = keep & (q_idx - kv_idx < window)
            if docs is not None:
                keep = keep & (docs[b, q_idx] == docs[b, kv_idx])
            return keep

        block_mask = kernels.block_mask(mask_mod, batch, seq_len, seq_len, device, f"window={window}")
        return AttentionMask(backend, document_ids=document_ids, block_mask=block_mask, **common)
    if document_ids is None:  # flash with a window only: the kernel's own window, no varlen
        return AttentionMask(backend, **common)
    # flash varlen over the flattened batch: a new sequence starts at every document change or row start.
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    idx = torch.nonzero(starts.flatten()).flatten().to(torch.int32)
    total = torch.tensor([batch * seq_len], dtype=torch.int32, device=device)
    cu = torch.cat([idx, total])
    max_len = int((cu[1:] - cu[:-1]).max().item())
    return AttentionMask(backend, document_ids=document_ids, cu_seqlens=cu, max_seqlen=max_len, **common)


def padding_mask(
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


def isolate_padding(document_ids: torch.Tensor | None, padding: torch.Tensor) -> torch.Tensor:
    """Document ids where each padding token is a document of its own (an id no other token has)."""
    docs = (
        torch.zeros_like(padding, dtype=torch.int64)
        if document_ids is None
        else document_ids.to(padding.device, torch.int64)
    )
    own = docs.max() + 1 + torch.arange(padding.shape[1], device=padding.device)
    return torch.where(padding, docs, own)
