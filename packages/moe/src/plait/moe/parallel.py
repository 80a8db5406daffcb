"""Put a MoE layer's experts on an expert-parallel device mesh dimension."""

from __future__ import annotations

from typing import Literal, get_args

from plait.moe.dispatch.all_gather import AllGatherDispatcher
from plait.moe.dispatch.all_to_all import AllToAllDispatcher
from plait.moe.dispatch.deepep import DeepEPDispatcher
from plait.moe.layer import MoELayer
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

ExpertDispatch = Literal["all_to_all", "all_gather", "deepep"]
"""How an expert-parallel layer exchanges tokens (the ``backend`` of :func:`expert_parallel`)."""


def expert_parallel(
    layer: MoELayer,
    ep_mesh: DeviceMesh,
    backend: ExpertDispatch = "all_to_all",
    num_chunks: int | None = None,
    buffer_factor: float | None = None,
) -> MoELayer:
    """Shard ``layer``'s experts over ``ep_mesh`` and switch it to expert-parallel dispatch.

    ``experts.gate_up_proj`` and ``experts.down_proj`` (and the experts' biases, if any) become DTensors ``Shard(0)`` (rank r of the
    mesh owns experts ``[r*E/P, (r+1)*E/P)``); the router and shared expert stay as they are
    (replicated; shard them with FSDP like any dense weight). Every rank routes its own tokens.

    Args:
        layer: The layer, modified in place. Its weights must be identical on all ranks of the mesh
            (rank 0's values are scattered); meta-device weights stay on meta.
        ep_mesh: A 1-D mesh, e.g. ``ctx.mesh_for("expert")["ep_shard"]``.
        backend: ``"all_to_all"`` (torch.distributed, any device), ``"all_gather"`` (tokens all-gathered, outputs
            reduce-scattered: no host synchronisation, fewer bytes than the all-to-all when the EP size is
            below top-k: :class:`AllGatherDispatcher`) or ``"deepep"`` (CUDA; needs ``plait-moe[deepep]``).
        num_chunks: ``"all_to_all"`` and ``"all_gather"``: token chunks pipelined so that the exchanges
            overlap the expert compute (see :class:`AllToAllDispatcher`, :class:`AllGatherDispatcher`);
            ``None`` = 1.
        buffer_factor: ``"all_gather"`` only: the permuted expert buffer holds ``buffer_factor`` times
            the rows a rank gets under balanced routing instead of the exact ``P * T * k`` bound; more
            assignments stop the step with a device-side assert naming
            ``parallel.expert_buffer_factor`` (see :class:`AllGatherDispatcher`). ``None`` = the
            exact bound.

    Returns:
        ``layer``.

    Raises:
        ImportError: ``backend="deepep"`` without DeepEP installed (names ``plait-moe[deepep]``).
        ValueError: a mesh that is not 1-D, experts not divisible by its size, applied twice, or
            ``num_chunks`` set for ``"deepep"`` or below 1, ``buffer_factor`` set for another backend
            than ``"all_gather"`` or not a finite number >= 1.
    """
    if ep_mesh.ndim != 1:
        raise ValueError(
            f"expert_parallel: ep_mesh must be 1-D (got dims {ep_mesh.mesh_dim_names}); pass the expert "
            "dimension, e.g. mesh['ep_shard']"
        )
    group = ep_mesh.get_group()
    # Before touching the layer, so a missing DeepEP or a bad backend leaves it unchanged.
    dispatcher: AllToAllDispatcher | AllGatherDispatcher | DeepEPDispatcher
    if backend not in get_args(ExpertDispatch):
        raise ValueError(
            f"expert_parallel: backend must be 'all_to_all', 'all_gather' or 'deepep', got {backend!r}"
        )
    if num_chunks is not None and backend == "deepep":
        raise ValueError(
            "expert_parallel: num_chunks applies to backends 'all_to_all' and 'all_gather', not 'deepep'"
        )
    if buffer_factor is not None and backend != "all_gather":
        raise ValueError(
            f"expert_parallel: buffer_factor (parallel.expert_buffer_factor) applies to backend 'all_gather' "
            f"only, not {backend!r}"
        )
    chunks = 1 if num_chunks is None else num_chunks
    if backend == "deepep":
        dispatcher = DeepEPDispatcher(group, layer.num_experts)
    elif backend == "all_gather":
        dispatcher = AllGatherDispatcher(group, chunks, buffer_factor)
    else:
        dispatcher = AllToAllDispatcher(group, chunks)
    ep = ep_mesh.size()
    if layer.num_experts % ep:
        raise ValueError(
            f"expert_parallel: num_experts ({layer.num_experts}) is not divisible by the EP size {ep}"
        )
    experts = layer.experts
    for name in ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"):
        param = getattr(experts, name)
        if param is None:  # experts without biases
            continue
        if isinstance(param, DTensor):
            raise ValueError(f"expert_parallel: experts.{name} is already a DTensor (applied twice?)")
        if param.is_meta:
            rank = ep_mesh.get_local_rank()
            n_local = layer.num_experts // ep
            local = param.data[rank * n_local : (rank + 1) * n_local]
            dt = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False)
        else:
            dt = distribute_tensor(param.data, ep_mesh, [Shard(0)])
        setattr(experts, name, nn.Parameter(dt, requires_grad=param.requires_grad))
    layer.dispatcher = dispatcher
    return layer
