"""Gradient synchronisation of plain (non-DTensor) parameters and DTensor-aware norm/clipping."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from plait.dist_core import (
    all_reduce_grads,
    clip_grad_norm_,
    global_grad_norm,
    is_replicated,
    parse_dtype,
    replicated_reduce,
)
from plait.loop.config.sections import GradientConfig
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["all_reduce_plain_grads", "clip_grad_norm", "prepare_fsdp_for_sum"]


def prepare_fsdp_for_sum(modules: Sequence[nn.Module]) -> list[nn.Module]:
    """Make FSDP2 reduce gradients by *sum* (divide factor 1), and other modules with FSDP2's
    ``set_gradient_divide_factor`` (a row-sharded token embedding, whose gradient comes out reduced); return
    the modules whose gradient sync can be switched off (FSDP2 modules and plait.dist_core ``replicate``-d
    modules).

    The loop normalises the loss by the global token count itself, so the data-parallel reduction
    must add, not average, the ranks' gradients.

    Raises:
        ValueError: for a module replicated with ``reduce="mean"`` (it cannot be switched here).
    """
    from torch.distributed.fsdp import FSDPModule

    found: list[nn.Module] = []
    for root in modules:
        for m in root.modules():
            if isinstance(m, FSDPModule):
                m.set_gradient_divide_factor(1.0)
                # A plain SUM (not PREMUL_SUM(1.0), which gloo lacks); exact on every backend.
                force_sum = getattr(m, "set_force_sum_reduction_for_comms", None)
                if force_sum is not None:
                    force_sum(True)
                found.append(m)
            elif callable(setter := getattr(m, "set_gradient_divide_factor", None)):
                setter(1.0)  # a module reducing its own gradients (a row-sharded embedding): always synced
            elif is_replicated(m):
                if (reduce := replicated_reduce(m)) != "sum":
                    raise ValueError(
                        f"{type(m).__name__} was replicated with reduce={reduce!r}; plait.loop normalises "
                        "by the global token count itself: use plait.dist_core.replicate(..., reduce='sum')"
                    )
                found.append(m)
    return found


def all_reduce_plain_grads(
    params: Iterable[nn.Parameter], group: dist.ProcessGroup | None, settings: GradientConfig
) -> None:
    """Sum the gradients of the non-DTensor parameters over ``group`` in flat buckets of
    ``settings.bucket_size_mb``, in ``settings.reduce_dtype`` (:func:`plait.dist_core.all_reduce_grads`;
    DTensor parameters are reduced by their own parallelism, e.g. FSDP2 in its mixed-precision policy).

    A parameter without a gradient on this rank (unused this step) contributes zeros, so every rank
    issues the same collectives.
    """
    plain = [p for p in params if not isinstance(p, DTensor)]
    dtype = None if settings.reduce_dtype is None else parse_dtype(settings.reduce_dtype)
    all_reduce_grads(plain, group, bucket_cap_mb=settings.bucket_size_mb, reduce_dtype=dtype)


@torch.no_grad()
def clip_grad_norm(
    params: Iterable[nn.Parameter],
    max_norm: float | None,
    norm_type: float = 2.0,
    pp_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Global gradient norm over DTensor and plain gradients (and pipeline stages), then clip.

    Delegates to plait.dist_core (gradients grouped by mesh, each group's norm made global, the
    pipeline stages' norms combined over ``pp_group``); ``max_norm=None`` only measures.

    Returns:
        The total norm before clipping (a 0-d float32 tensor, equal on all ranks).
    """
    params = list(params)
    if max_norm is None:
        return global_grad_norm(params, norm_type, pipeline_group=pp_group)
    return clip_grad_norm_(params, max_norm, norm_type, pipeline_group=pp_group)
