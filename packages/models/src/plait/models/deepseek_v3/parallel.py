"""DeepSeek-V3's tensor-parallel layer plan: not implemented for multi-head latent attention."""

from __future__ import annotations

from plait.models.common.layer import DecoderLayer
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["tp_mla_layer"]


def tp_mla_layer(layer: DecoderLayer, tp_mesh: DeviceMesh) -> None:
    """Refuses tensor parallelism: sharding MLA by head needs the gradient of the shared rope key
    (and of the latent projections) summed over the tensor group, which plait does not do yet.

    Raises:
        ValueError: always (use FSDP2 / HSDP, expert and pipeline parallelism instead).
    """
    del layer
    raise ValueError(
        f"tensor parallelism (tp={tp_mesh.size()}) is not supported for DeepSeek-V3's multi-head latent "
        "attention; use FSDP2/HSDP with expert and pipeline parallelism (mesh tensor size 1)"
    )
