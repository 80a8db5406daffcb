"""The optional fla-core kernels (``pip install 'plait-models[fla]'``) for gated DeltaNet layers on CUDA.

Imported only when a layer runs them; the PyTorch path (:mod:`.delta_rule`, :mod:`.conv`) is the
default and the reference. Packed documents become fla's variable-length layout: the batch is
flattened into one row and ``cu_seqlens`` marks every document (and row) start.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "FLA_EXTRA",
    "FlaKernels",
    "cu_seqlens_from_document_ids",
    "fla_available",
    "fla_causal_conv1d",
    "fla_gated_delta_rule",
    "fla_kernels",
    "fla_unusable",
]

FLA_EXTRA = "pip install 'plait-models[fla]'"


def fla_available() -> bool:
    """Whether fla-core (``import fla``) is importable (it is imported lazily, only when used)."""
    return importlib.util.find_spec("fla") is not None


def _installed(distribution: str) -> bool:
    """Whether ``distribution`` is installed (looked up, not imported: fla imports it itself)."""
    try:
        importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def fla_unusable() -> str | None:
    """Why fla's kernels cannot train on this machine's GPU, or None when they can: fla-core missing, or
    fla's own refusal of its gated-delta-rule backward on Hopper GPUs with Triton >= 3.4, < 3.7.1 (wrong
    results there, fla issue #640) unless tilelang is installed."""
    if not fla_available():
        return f"fla-core is not installed ({FLA_EXTRA})"
    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9:
        triton = importlib.metadata.version("triton")
        version = tuple(int(p) for p in triton.split("+")[0].split(".")[:3] if p.isdigit())
        if (3, 4, 0) <= version < (3, 7, 1) and not _installed("tilelang"):
            return (
                f"fla-core's gated delta rule refuses to train on Hopper GPUs with Triton {triton} "
                "(wrong gradients below 3.7.1): upgrade Triton to >= 3.7.1 or pip install tilelang"
            )
    return None


@dataclass(frozen=True)
class FlaKernels:
    """fla-core's causal convolution and chunked gated delta rule, imported (see :func:`fla_kernels`)."""

    causal_conv1d: Callable[..., Any]
    chunk_gated_delta_rule: Callable[..., Any]


def fla_kernels() -> FlaKernels:
    """Import fla-core's kernels now (a layer does it when it is built, never inside a compiled forward).

    Raises:
        ImportError: fla-core is not installed (naming the extra).
    """
    try:
        conv = importlib.import_module("fla.modules.causal_conv1d").causal_conv1d
        chunk = importlib.import_module("fla.ops.gated_delta_rule").chunk_gated_delta_rule
    except ImportError as e:
        raise ImportError(f"linear_attn_implementation='fla' needs fla-core: {FLA_EXTRA} ({e})") from None
    return FlaKernels(conv, chunk)


def cu_seqlens_from_document_ids(document_ids: torch.Tensor) -> torch.Tensor:
    """Cumulative lengths (int64 ``[N + 1]``) of the documents of ``[B, S]`` ids over the flattened batch."""
    b, s = document_ids.shape
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    idx = torch.nonzero(starts.flatten()).flatten()
    return torch.cat([idx, idx.new_tensor([b * s])]).to(torch.long)


def fla_causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, document_ids: torch.Tensor | None = None, *, kernels: FlaKernels
) -> torch.Tensor:
    """:func:`plait.models.common.linear_attention.causal_conv1d` followed by SiLU, on fla's kernel
    (``fla.modules.causal_conv1d.causal_conv1d``)."""
    conv = kernels.causal_conv1d
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
    kernels: FlaKernels,
) -> torch.Tensor:
    """:func:`plait.models.common.linear_attention.chunk_gated_delta_rule` (q/k L2-normalised in the
    kernel) on fla's ``chunk_gated_delta_rule``. q/k are repeated to the value heads first, which
    every fla-core release accepts."""
    chunk = kernels.chunk_gated_delta_rule
    g, beta = g.contiguous(), beta.contiguous()  # GatedDeltaNet passes heads-first transposed views
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
