"""The optional fla-core kernels (``pip install 'plait-models[fla]'``) for gated DeltaNet layers on CUDA.

Imported only when a layer runs them; the PyTorch path (:mod:`.delta_rule`, :mod:`.conv`) is the
default and the reference. Packed documents become fla's variable-length layout: the batch is
flattened into one row and ``cu_seqlens`` marks every document (and row) start.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

__all__ = [
    "FLA_EXTRA",
    "cu_seqlens_from_document_ids",
    "fla_available",
    "fla_causal_conv1d",
    "fla_gated_delta_rule",
]

FLA_EXTRA = "pip install 'plait-models[fla]'"


def fla_available() -> bool:
    """Whether fla-core (``import fla``) is importable (it is imported lazily, only when used)."""
    return importlib.util.find_spec("fla") is not None


def _import(module: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"linear_attn_implementation='fla' needs fla-core: {FLA_EXTRA} ({e})") from None


def cu_seqlens_from_document_ids(document_ids: torch.Tensor) -> torch.Tensor:
    """Cumulative lengths (int64 ``[N + 1]``) of the documents of ``[B, S]`` ids over the flattened batch."""
    b, s = document_ids.shape
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    idx = torch.nonzero(starts.flatten()).flatten()
    return torch.cat([idx, idx.new_tensor([b * s])]).to(torch.long)


def fla_causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, document_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """:func:`plait.models.common.linear_attention.causal_conv1d` followed by SiLU, on fla's kernel
    (``fla.modules.causal_conv1d.causal_conv1d``)."""
    conv = _import("fla.modules.causal_conv1d").causal_conv1d
    if document_ids is None:
        out, _ = conv(x, weight, activation="silu")
        return out
    b, s, c = x.shape
    out, _ = conv(
        x.reshape(1, b * s, c),
        weight,
        activation="silu",
        cu_seqlens=cu_seqlens_from_document_ids(document_ids),
    )
    return out.reshape(b, s, c)


def fla_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    document_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`plait.models.common.linear_attention.chunk_gated_delta_rule` (q/k L2-normalised in the
    kernel) on fla's ``chunk_gated_delta_rule``. q/k are repeated to the value heads first, which
    every fla-core release accepts."""
    chunk = _import("fla.ops.gated_delta_rule").chunk_gated_delta_rule
    rep = v.shape[2] // q.shape[2]
    if rep > 1:
        q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
    if document_ids is None:
        out, _ = chunk(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
        return out
    b, s = q.shape[:2]
    flat = [t.reshape(1, b * s, *t.shape[2:]) for t in (q, k, v, g, beta)]
    cu = cu_seqlens_from_document_ids(document_ids)
    out, _ = chunk(*flat, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
    return out.reshape(b, s, *out.shape[2:])
