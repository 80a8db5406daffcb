"""Qwen3.5 / Qwen3-Next tensor-parallel layer plan."""

from __future__ import annotations

from plait.models.common.attention import GroupedQueryAttention
from plait.models.common.layer import DecoderLayer
from plait.models.common.parallel.plan import dense_mlp_plan, tp_gqa_layer
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import parallelize_module

__all__ = ["tp_hybrid_layer"]


def tp_hybrid_layer(layer: DecoderLayer, tp_mesh: DeviceMesh) -> None:
    """Megatron-style tensor parallelism of one layer.

    Full-attention layers: :func:`tp_gqa_layer` (the gated ``q_proj`` keeps each head's query and
    gate rows together, so a column shard holds whole heads). Gated DeltaNet layers run replicated
    over ``tp`` (every rank computes the whole mixer; its gradients are identical on every rank):
    sharding their heads needs the q/k/v sections of the fused projection and of the convolution
    split per rank, which a plain ``Shard(0)`` does not give. Dense SwiGLU MLPs are column/row
    parallel on both kinds; MoE blocks run replicated (shard them with expert parallelism).
    """
    if isinstance(layer.self_attn, GroupedQueryAttention):
        tp_gqa_layer(layer, tp_mesh)
        return
    plan = dense_mlp_plan(layer)
    if plan:
        parallelize_module(layer, tp_mesh, plan)
