"""Generic parallelize applicators: DTensor replication with bucketed all-reduce, FSDP2 and HSDP,
and the bucketed gradient all-reduce itself (:func:`all_reduce_grads`).

The applicators take the gradient reduction explicitly: ``reduce="mean"`` divides the summed gradients by
the number of data-parallel ranks (the usual choice when every rank's loss is a mean over its own
batch), ``reduce="sum"`` leaves the sum (when losses are already normalised by the global count).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
from plait.dist_core import fsdp_copy_in
from plait.dist_core.fsdp_state import param_groups
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate
from torch.utils._pytree import tree_map

Reduce = Literal["mean", "sum"]


def _check_reduce(reduce: str) -> None:
    if reduce not in ("mean", "sum"):
        raise ValueError(f"reduce must be 'mean' or 'sum', got {reduce!r}")


# --------------------------------------------------------------------------------------------------
# bucketed gradient all-reduce
# --------------------------------------------------------------------------------------------------
def _to_local(x: Any) -> Any:
    return x.to_local() if isinstance(x, DTensor) else x


def _grad_buckets(params: Sequence[nn.Parameter], cap_bytes: float) -> list[list[nn.Parameter]]:
    """``params`` in buckets of at most about ``cap_bytes`` (one dtype and device per bucket), in order."""
    by_kind: dict[tuple[torch.dtype, torch.device], list[nn.Parameter]] = {}
    for p in params:
        local = _to_local(p.data)
        by_kind.setdefault((local.dtype, local.device), []).append(p)
    buckets: list[list[nn.Parameter]] = []
    for same in by_kind.values():
        current: list[nn.Parameter] = []
        size = 0
        for p in same:
            nbytes = _to_local(p.data).numel() * p.element_size()
            if current and size + nbytes > cap_bytes:
                buckets.append(current)
                current, size = [], 0
            current.append(p)
            size += nbytes
        if current:
            buckets.append(current)
    return buckets


def _flatten_grads(params: Sequence[nn.Parameter]) -> torch.Tensor:
    """The local gradients of ``params`` in one flat tensor (zeros for a parameter without one)."""
    grads = [torch.zeros_like(_to_local(p.data)) if p.grad is None else _to_local(p.grad) for p in params]
    return torch.cat([g.reshape(-1) for g in grads])


def _unflatten_grads(params: Sequence[nn.Parameter], flat: torch.Tensor) -> None:
    """Write ``flat`` back into the gradients of ``params`` (creating the missing ones)."""
    offset = 0
    for p in params:
        local = _to_local(p.data)
        reduced = flat[offset : offset + local.numel()].view(local.shape)
        offset += local.numel()
        if p.grad is not None:
            _to_local(p.grad).copy_(reduced)
        elif isinstance(p, DTensor):
            p.grad = DTensor.from_local(reduced.clone(), p.device_mesh, p.placements, run_check=False)
        else:
            p.grad = reduced.clone()


def all_reduce_grads(
    params: Iterable[nn.Parameter],
    group: dist.ProcessGroup | None = None,
    *,
    bucket_cap_mb: float = 25.0,
    reduce_dtype: torch.dtype | None = None,
) -> None:
    """Sum the gradients of ``params`` over ``group`` in flat buckets of about ``bucket_cap_mb`` MiB.

    Only parameters that require a gradient take part. One without a gradient on this rank (unused
    in this step) contributes zeros and receives the sum, so every rank issues the same collectives.
    DTensor parameters reduce their local tensors. Collective: every rank of ``group`` calls it with
    the same parameters in the same order. :func:`replicate` uses the same buckets, reduced while
    backward runs.

    Args:
        params: the parameters whose gradients to sum.
        group: the process group (default: the world).
        bucket_cap_mb: bucket size in MiB.
        reduce_dtype: dtype the buckets are summed in (e.g. float32 for bf16 gradients); None: the
            gradients' own dtype.
    """
    trainable = [p for p in params if p.requires_grad]
    for bucket in _grad_buckets(trainable, bucket_cap_mb * 2**20):
        flat = _flatten_grads(bucket)
        wire = flat if reduce_dtype is None else flat.to(reduce_dtype)
        dist.all_reduce(wire, group=group)
        _unflatten_grads(bucket, wire.to(flat.dtype))


# --------------------------------------------------------------------------------------------------
# replicate
# --------------------------------------------------------------------------------------------------
@dataclass
class _Bucket:
    params: list[nn.Parameter]
    ready: int = 0
    work: Any = None
    flat: torch.Tensor | None = None


@dataclass
class _ReplicateState:
    mesh: DeviceMesh
    reduce: Reduce
    buckets: list[_Bucket] = field(default_factory=list)
    bucket_of: dict[int, _Bucket] = field(default_factory=dict)
    sync: bool = True
    callback_queued: bool = False


def _replicated(mesh: DeviceMesh) -> list[Replicate]:
    return [Replicate()] * mesh.ndim


def _to_dtensor(mesh: DeviceMesh) -> Callable[[Any], Any]:
    def convert(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and not isinstance(x, DTensor):
            return DTensor.from_local(x, mesh, _replicated(mesh), run_check=False)
        return x

    return convert


def _broadcast_from_first(t: torch.Tensor, mesh: DeviceMesh) -> None:
    # Along every mesh dim from coordinate 0: all replicas start from mesh rank 0's values.
    for dim in range(mesh.ndim):
        group = mesh.get_group(dim)
        dist.broadcast(t, src=dist.get_global_rank(group, 0), group=group)


# The modules made data-parallel by replicate(), with their gradient-reduction state: the one registry
# other packages ask through is_replicated() / replicated_reduce(). Weak keys: a dropped module leaves it.
_REPLICATED: weakref.WeakKeyDictionary[nn.Module, _ReplicateState] = weakref.WeakKeyDictionary()


def is_replicated(module: nn.Module) -> bool:
    """Whether ``module`` was made data-parallel by :func:`replicate` (its gradients all-reduced by plait)."""
    return module in _REPLICATED


def replicated_reduce(module: nn.Module) -> Reduce:
    """How :func:`replicate` reduces the gradients of ``module``: ``"mean"`` or ``"sum"``.

    Raises:
        TypeError: ``module`` was not replicated.
    """
    state = _REPLICATED.get(module)
    if state is None:
        raise TypeError(f"{type(module).__name__} was not parallelized with replicate()")
    return state.reduce


def _launch(bucket: _Bucket, state: _ReplicateState) -> None:
    bucket.flat = _flatten_grads(bucket.params)
    # Overlap: the first mesh dim reduces asynchronously while backward continues.
    bucket.work = dist.all_reduce(bucket.flat, group=state.mesh.get_group(0), async_op=True)


def _finish(state: _ReplicateState) -> None:
    state.callback_queued = False
    size = state.mesh.size()
    for bucket in state.buckets:
        if bucket.work is None:
            # Some parameters got no gradient in this backward: reduce zeros for them so every
            # rank issues the same collectives.
            _launch(bucket, state)
        assert bucket.flat is not None
        bucket.work.wait()
        for dim in range(1, state.mesh.ndim):
            dist.all_reduce(bucket.flat, group=state.mesh.get_group(dim))
        if state.reduce == "mean":
            bucket.flat.div_(size)
        _unflatten_grads(bucket.params, bucket.flat)
        bucket.ready, bucket.work, bucket.flat = 0, None, None


def _make_hook(state: _ReplicateState) -> Callable[[torch.Tensor], None]:
    def hook(param: torch.Tensor) -> None:
        if not state.sync:
            return
        if not state.callback_queued:
            state.callback_queued = True
            # No public API runs a callback at the end of the current backward; DDP and FSDP use this one.
            torch.autograd.Variable._execution_engine.queue_callback(lambda: _finish(state))  # noqa: SLF001
        bucket = state.bucket_of[id(param)]
        bucket.ready += 1
        if bucket.ready == len(bucket.params):
            _launch(bucket, state)

    return hook


def replicate(
    module: nn.Module, mesh: DeviceMesh, *, reduce: Reduce = "mean", bucket_cap_mb: float = 25.0
) -> nn.Module:
    """Data-parallel replication with DTensor parameters (like DDP, PyTorch-native placements).

    - Every parameter becomes a ``DTensor`` with ``Replicate()`` on every dim of ``mesh``,
      initialised from mesh rank 0's values (broadcast), so all replicas start equal.
    - Tensor inputs of ``module`` become replicated DTensors and DTensor outputs become local
      tensors again, so callers pass and get plain tensors.
    - Gradients are all-reduced in buckets of about ``bucket_cap_mb`` MiB (in reverse
      registration order, roughly the order backward produces them); a bucket's all-reduce starts
      as soon as its last gradient is accumulated and all are awaited at the end of backward.
      Parameters that got no gradient are reduced as zeros (every rank issues the same collectives).
    - ``reduce="mean"`` divides by the number of ranks of ``mesh``; ``"sum"`` does not.

    Use :func:`set_gradient_sync` to skip the all-reduce on gradient-accumulation micro-steps.

    Args:
        module: the module to replicate in place.
        mesh: the data-parallel mesh (any number of dims; all are replicated over).
        reduce: ``"mean"`` or ``"sum"``.
        bucket_cap_mb: bucket size in MiB.

    Returns:
        ``module`` (modified in place).
    """
    _check_reduce(reduce)
    state = _ReplicateState(mesh, reduce)
    seen: dict[int, nn.Parameter] = {}
    for sub in module.modules():
        for name, p in list(sub.named_parameters(recurse=False)):
            if id(p) in seen:  # tied weights stay tied
                setattr(sub, name, seen[id(p)])
                continue
            data = p.detach().clone()
            _broadcast_from_first(data, mesh)
            new = nn.Parameter(
                DTensor.from_local(data, mesh, _replicated(mesh), run_check=False),
                requires_grad=p.requires_grad,
            )
            seen[id(p)] = new
            setattr(sub, name, new)
    trainable = [p for p in reversed(list(seen.values())) if p.requires_grad]
    state.buckets = [_Bucket(b) for b in _grad_buckets(trainable, bucket_cap_mb * 2**20)]
    hook = _make_hook(state)
    for bucket in state.buckets:
        for p in bucket.params:
            state.bucket_of[id(p)] = bucket
            p.register_post_accumulate_grad_hook(hook)

    convert = _to_dtensor(mesh)
    module.register_forward_pre_hook(
        lambda _m, args, kwargs: tree_map(convert, (args, kwargs)), with_kwargs=True
    )
    module.register_forward_hook(lambda _m, _args, out: tree_map(_to_local, out))
    _REPLICATED[module] = state
    return module


def set_gradient_sync(module: nn.Module, enabled: bool, *, recurse: bool = True) -> None:
    """Turn the gradient all-reduce of a :func:`replicate`-d or FSDP2 module on or off.

    Off for all but the last micro-batch of a gradient-accumulation step: gradients accumulate
    locally and the last backward reduces the accumulated sum. ``recurse`` (FSDP2): also its FSDP2
    submodules (a walk over all its modules; a caller that switches every FSDP2 module itself passes
    False).
    """
    state = _REPLICATED.get(module)
    if state is not None:
        state.sync = enabled
    elif isinstance(module, FSDPModule):
        module.set_requires_gradient_sync(enabled, recurse=recurse)
    else:
        raise TypeError(
            f"{type(module).__name__} was not parallelized with replicate() or fully_shard_module()"
        )


# --------------------------------------------------------------------------------------------------
# FSDP2 / HSDP
# --------------------------------------------------------------------------------------------------
def prefetch_all_gathers(module: nn.Module, units: int) -> list[FSDPModule]:
    """Start the all-gathers that open ``module``'s next forward: those of its first ``units`` FSDP2 units in
    module order, the root's first (for a decoder stage: the root's own parameters, the token embedding's
    unit, the first decoder layers' unit), each ``unshard(async_op=True)``; FSDP2's pre-forward waits on
    them (a unit already gathered has nothing to start). Modules without parameters are passed over.

    Call it where nothing changes the parameters before the next forward (after the optimizer step and
    whatever follows it): each gather copies the sharded parameters when it starts. A training loop calls it
    at the end of a step, so that these all-gathers run while the host prepares the next step instead of
    holding up its first layers (``fsdp.prefetch_units`` of ``plait.loop``).

    Returns:
        The FSDP2 modules asked to gather (one per unit; a unit of several modules once).

    Raises:
        ValueError: ``units`` below 0.
    """
    if units < 0:
        raise ValueError(f"prefetch_all_gathers: units must be >= 0 (0 starts none), got {units}")
    asked: list[FSDPModule] = []
    seen: set[int] = set()
    for m in module.modules():
        if len(asked) == units:
            break
        if not isinstance(m, FSDPModule):
            continue
        groups = param_groups(m)
        if not groups or id(groups[0]) in seen:
            continue
        seen.add(id(groups[0]))
        m.unshard(async_op=True)
        asked.append(m)
    return asked


def data_parallel_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh FSDP2 shards over, taken from the dense domain (or returned as given).

    For a dense-domain mesh: ``mesh["dp_replicate", "dp_cp_shard"]`` (HSDP: replicate over
    ``dp_replicate``, shard over ``dp_cp_shard``) when ``dp_replicate > 1``, else
    ``mesh["dp_cp_shard"]`` (FSDP). A 1-D or 2-D mesh without those names is used as given
    (2-D means HSDP with dim 0 replicate, dim 1 shard).

    Raises:
        ValueError: ``cp_replicate > 1`` (its gradients would need a third reduction FSDP2 does
            not do), or a mesh with more than 2 dims that is not a dense-domain mesh.
    """
    names = mesh.mesh_dim_names or ()
    if "dp_cp_shard" in names:
        if "cp_replicate" in names and mesh["cp_replicate"].size() > 1:
            raise ValueError("fully_shard_module does not support context_replicate > 1; use context_shard")
        if "dp_replicate" in names and mesh["dp_replicate"].size() > 1:
            return mesh["dp_replicate", "dp_cp_shard"]
        return mesh["dp_cp_shard"]
    if mesh.ndim > 2:
        raise ValueError(
            f"fully_shard_module needs the dense-domain mesh or a 1-D/2-D data-parallel mesh, got dims {names}"
        )
    return mesh


def _set_divide_factor(module: FSDPModule, factor: float) -> None:
    # torch >= 2.8 names it set_gradient_divide_factor; older releases set_reduce_scatter_divide_factor.
    setter = getattr(module, "set_gradient_divide_factor", None) or getattr(
        module, "set_reduce_scatter_divide_factor", None
    )
    if setter is None:
        raise NotImplementedError(f"torch {torch.__version__}: FSDP2 has no gradient divide factor setter")
    setter(factor)


def fully_shard_module(
    module: nn.Module,
    mesh: DeviceMesh,
    *,
    reshard_after_forward: bool | int = True,
    mp_policy: MixedPrecisionPolicy | None = None,
    reduce: Reduce = "mean",
) -> FSDPModule:
    """Apply FSDP2 ``fully_shard`` (or HSDP) to ``module`` over the dense domain's data ranks.

    Call it bottom-up (blocks first, then the root), like ``fully_shard``; each call covers the
    parameters of ``module`` not already sharded by an inner call.

    Args:
        module: the module to shard in place.
        mesh: the dense-domain mesh (``ctx.mesh_for("dense")``) or a data-parallel mesh; see
            :func:`data_parallel_mesh`.
        reshard_after_forward: as in ``fully_shard``.
        mp_policy: mixed precision (default: parameters' dtype throughout).
        reduce: ``"mean"`` divides gradients by the number of data-parallel ranks (replicas x
            shards, FSDP2's default); ``"sum"`` sets the divide factor to 1.

    Returns:
        The module (now an ``FSDPModule``).
    """
    _check_reduce(reduce)
    fsdp_copy_in.install()
    dp_mesh = data_parallel_mesh(mesh)
    kwargs: dict[str, Any] = {"mesh": dp_mesh, "reshard_after_forward": reshard_after_forward}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    sharded = fully_shard(module, **kwargs)
    assert isinstance(sharded, FSDPModule)
    if reduce == "sum":
        _set_divide_factor(sharded, 1.0)
        # A factor other than the group size becomes NCCL's PreMulSum, which gloo lacks: there,
        # reduce with plain SUM (the factor is then applied as a separate scaling).
        if "nccl" not in str(dist.get_backend(dp_mesh.get_group(dp_mesh.ndim - 1))).lower():
            force_sum = getattr(sharded, "set_force_sum_reduction_for_comms", None)
            if force_sum is None:
                raise NotImplementedError(f"torch {torch.__version__}: FSDP2 cannot sum gradients over gloo")
            force_sum(True)
    return sharded
