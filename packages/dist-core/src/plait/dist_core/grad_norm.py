"""Global gradient norm and clipping over parameters that live on different meshes.

Each gradient is a plain tensor or a DTensor on any mesh (FSDP ``Shard``, ``Replicate``,
expert-sharded, FSDP over experts (``_StridedShard``), HSDP ...). The norm counts every element exactly once:

1. per gradient, the local shard's ``sum |g|^p`` (``max |g|`` for the inf-norm), in float32;
2. grouped by (mesh, the mesh dims where the gradient is ``Shard`` or ``_StridedShard``), summed (max-ed) over the
   ranks of those dims only: dims where it is ``Replicate`` hold copies and are not summed;
   plain tensors are taken as they are (copies on ranks that hold them);
3. summed over pipeline stages through ``pipeline_group`` (each stage holds different parameters).

Every rank of a group must pass the same parameters in the same order (true for ranks of one
pipeline stage running the same model), since step 2 issues collectives per group.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

# FSDP over expert-parallel parameters shards dim 0 twice (_StridedShard on the outer mesh dim); newer torch
# no longer derives _StridedShard from Shard. Either way each rank holds a disjoint piece of the tensor.
_SHARDS = (Shard, _StridedShard)

_TensorOrTensors = torch.Tensor | Iterable[torch.Tensor]


def _grads(params: _TensorOrTensors) -> list[torch.Tensor]:
    if isinstance(params, torch.Tensor):
        params = [params]
    return [p.grad for p in params if p.grad is not None]


def _mesh_key(mesh: DeviceMesh) -> tuple[object, ...]:
    """What makes two meshes the same group of ranks (``mesh.mesh`` is recomputed at every access: a
    caller asks once per mesh object, not once per gradient)."""
    ranks = mesh.mesh
    return (mesh.device_type, tuple(mesh.mesh_dim_names or ()), tuple(ranks.flatten().tolist()), ranks.shape)


def _power_sum(tensors: list[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    """``sum |g|^p`` (``max |g|`` for the inf-norm) over all elements of ``tensors``, float32 on ``device``.

    One fused ``_foreach_norm`` per (device, dtype) (float32 accumulation, no float32 copy of the
    gradients), as ``torch.nn.utils.clip_grad_norm_(foreach=True)`` does.
    """
    inf = math.isinf(norm_type)
    total = torch.zeros((), dtype=torch.float32, device=device)
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        if t.numel():
            groups.setdefault((t.device, t.dtype), []).append(t.detach())
    for group in groups.values():
        # One kernel per group, as torch.nn.utils.get_total_norm does (the op has no public name).
        norms = torch.stack(torch._foreach_norm(group, norm_type, dtype=torch.float32))  # noqa: SLF001
        part = norms.amax() if inf else norms.pow(norm_type).sum()
        total = torch.maximum(total, part.to(device)) if inf else total + part.to(device)
    return total


def global_grad_norm(
    params: _TensorOrTensors, norm_type: float = 2.0, *, pipeline_group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """The norm of all gradients of ``params`` as if they were one unsharded vector.

    Args:
        params: parameters (plain tensors or DTensors); those without ``.grad`` are skipped.
        norm_type: p of the p-norm (``float("inf")`` for the max-norm).
        pipeline_group: the group of this rank's pipeline peers (e.g.
            ``ctx.mesh_for("batch").get_group("pp")``), or None without pipelining.

    Returns:
        A float32 0-d tensor, equal on all ranks, on the gradients' device.
    """
    inf = math.isinf(norm_type)
    if not inf and norm_type <= 0:
        raise ValueError(f"norm_type must be > 0 or inf, got {norm_type}")
    combine = torch.maximum if inf else torch.add
    op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM

    grads = _grads(params)
    device = grads[0].device if grads else torch.device("cpu")
    plain: list[torch.Tensor] = []
    by_group: dict[tuple[object, ...], tuple[DeviceMesh, list[int], list[torch.Tensor]]] = {}
    mesh_keys: dict[int, tuple[object, ...]] = {}  # id(mesh) -> _mesh_key(mesh)
    for g in grads:
        if isinstance(g, DTensor):
            placements = g.placements
            if any(not isinstance(pl, (*_SHARDS, Replicate)) for pl in placements):
                raise ValueError(
                    f"gradient with placements {placements}: reduce partial gradients before the norm"
                )
            shard_dims = [i for i, pl in enumerate(placements) if isinstance(pl, _SHARDS)]
            mesh = g.device_mesh
            if (mesh_key := mesh_keys.get(id(mesh))) is None:
                mesh_key = mesh_keys[id(mesh)] = _mesh_key(mesh)
            key = (mesh_key, tuple(shard_dims))
            by_group.setdefault(key, (mesh, shard_dims, []))[2].append(g.to_local())
        else:
            plain.append(g)

    total = _power_sum(plain, norm_type, device)
    for mesh, dims, locals_ in by_group.values():
        acc = _power_sum(locals_, norm_type, locals_[0].device)
        for dim in dims:
            dist.all_reduce(acc, op=op, group=mesh.get_group(dim))
        total = combine(total, acc.to(device))
    if pipeline_group is not None and dist.get_world_size(pipeline_group) > 1:
        dist.all_reduce(total, op=op, group=pipeline_group)
    return total if inf else total ** (1.0 / norm_type)


def clip_factor(total: torch.Tensor, max_norm: float) -> torch.Tensor:
    """The factor that clipping multiplies the gradients by: ``max_norm / (total + 1e-6)`` clamped to 1
    (``torch.nn.utils.clip_grad_norm_``'s rule), a device tensor (no host sync)."""
    return torch.clamp(max_norm / (total + 1e-6), max=1.0)


def clip_grad_norm_(
    params: _TensorOrTensors,
    max_norm: float,
    norm_type: float = 2.0,
    *,
    pipeline_group: dist.ProcessGroup | None = None,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """Scale all gradients in place so that their global norm is at most ``max_norm``.

    Same rule as ``torch.nn.utils.clip_grad_norm_`` (factor ``max_norm / (norm + 1e-6)``
    clamped to 1), with the norm from :func:`global_grad_norm`.

    Returns:
        The global norm before clipping (float32 0-d tensor).

    Raises:
        RuntimeError: ``error_if_nonfinite`` and the norm is nan or inf.
    """
    if isinstance(params, torch.Tensor):
        params = [params]
    params = list(params)
    total = global_grad_norm(params, norm_type, pipeline_group=pipeline_group)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"the total norm of order {norm_type} of the gradients is non-finite: {total.item()}"
        )
    coef = clip_factor(total, max_norm)
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in _grads(params):
        local = g.to_local() if isinstance(g, DTensor) else g
        groups.setdefault((local.device, local.dtype), []).append(local)
    with torch.no_grad():
        for (dev, dtype), locals_ in groups.items():
            torch._foreach_mul_(locals_, coef.to(device=dev, dtype=dtype))
    return total
