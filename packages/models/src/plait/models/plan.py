"""``parallelize`` for every family: the decoder plan with the family's tensor-parallel layout."""

from __future__ import annotations

from plait.dist_core import DistributedContext
from plait.models.common.model import DecoderStage
from plait.models.common.parallel import ParallelConfig, parallelize_decoder
from plait.models.registry import family_of
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["parallelize"]


def parallelize(
    model: DecoderStage,
    *,
    dense_mesh: DeviceMesh | None = None,
    expert_mesh: DeviceMesh | None = None,
    config: ParallelConfig | None = None,
    context: DistributedContext | None = None,
    cp_mesh: DeviceMesh | None = None,
) -> DecoderStage:
    """Apply TP, CP, EP, activation checkpointing, compile and FSDP2/HSDP to a stage, in place, in
    torchtitan's order; the family (from ``model.config``) gives the tensor-parallel layout of its
    layers. See :func:`plait.models.common.parallel.parallelize_decoder` for the arguments."""
    return parallelize_decoder(
        model,
        layer_plan=family_of(model.config).tp_layer_plan,
        dense_mesh=dense_mesh,
        expert_mesh=expert_mesh,
        config=config,
        context=context,
        cp_mesh=cp_mesh,
    )
