"""DeepSeek-V3's tensor-parallel layer plan: multi-head latent attention sharded by head."""

from __future__ import annotations

from typing import Any

from plait.models.common.layer import DecoderLayer
from plait.models.common.parallel.plan import dense_mlp_plan
from plait.models.deepseek_v3.attention import MultiHeadLatentAttention
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

__all__ = ["tp_mla_layer"]


def tp_mla_layer(layer: DecoderLayer, tp_mesh: DeviceMesh) -> None:
    """Megatron-style tensor parallelism of one DeepSeek-V3 layer: attention heads split over ``tp``.

    ``q_b_proj`` (``q_proj`` without ``q_lora_rank``) and ``kv_b_proj`` column-parallel, ``o_proj``
    row-parallel; the latent path (``q_a_proj``, ``kv_a_proj_with_mqa``, ``q_a_layernorm``,
    ``kv_a_layernorm``) stays replicated. The column-parallel projections sum their input's
    gradient over ``tp`` (the latents' share); the rope key, read by every local head outside them,
    is summed by the attention itself (``tp_group``). So every replicated weight gets the whole
    gradient on each rank. Dense SwiGLU layers: gate/up column-parallel, down row-parallel; MoE
    blocks (routed and shared experts) run replicated over ``tp``, as in the other MoE families
    (shard them with expert parallelism).
    """
    attn = layer.self_attn
    assert isinstance(attn, MultiHeadLatentAttention)
    plan: dict[str, Any] = {
        "self_attn.q_proj" if attn.q_proj is not None else "self_attn.q_b_proj": ColwiseParallel(),
        "self_attn.kv_b_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(),
    }
    plan.update(dense_mlp_plan(layer))
    parallelize_module(layer, tp_mesh, plan)
    attn.tp_group = tp_mesh.get_group()
