"""Parallelisation settings for plait models."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["ActivationCheckpointing", "ParallelConfig"]


class ActivationCheckpointing(BaseModel):
    """Activation checkpointing of decoder layers.

    Attributes:
        mode: ``none``; ``full`` (recompute the whole layer in backward); ``selective`` (recompute
            the layer but keep the outputs of the ops in ``save_ops``).
        every: Checkpoint every k-th layer (by global layer index: layers with ``idx % every == 0``).
        save_ops: ``selective`` only: op names whose outputs are saved instead of recomputed
            (default: the expensive ones, as torchtitan's per-op policy: matmuls, the experts' grouped
            GEMMs, attention kernels, and the collectives of tensor and expert parallelism, whose
            recomputation would repeat the communication).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    mode: Literal["none", "full", "selective"] = "none"
    every: int = Field(default=1, ge=1)
    save_ops: tuple[str, ...] = (
        "aten.mm.default",
        "aten.addmm.default",
        "aten.bmm.default",
        "aten._scaled_dot_product_efficient_attention.default",
        "aten._scaled_dot_product_flash_attention.default",
        "aten._scaled_dot_product_flash_attention_for_cpu.default",
        "aten._scaled_dot_product_cudnn_attention.default",
        "aten._flash_attention_forward.default",
        "aten._efficient_attention_forward.default",
        "aten._grouped_mm.default",
        "plait.gmm.default",
        "_c10d_functional.reduce_scatter_tensor.default",
        "_c10d_functional.all_to_all_single.default",
    )


class ParallelConfig(BaseModel):
    """How :func:`plait.models.parallelize` distributes a model.

    Attributes:
        data_parallel: ``fsdp`` shards parameters over the dense mesh's ``dp_cp_shard`` dim and
            replicates over ``dp_replicate`` (HSDP when both > 1; plain replication when only
            ``dp_replicate`` > 1); ``none`` leaves gradient synchronisation to the caller.
        reshard_after_forward: FSDP2 ``reshard_after_forward`` (None: FSDP's default).
        fsdp_layers_per_unit: Consecutive decoder layers that share one FSDP2 unit (one
            all-gather, one reduce-scatter and one set of hooks per unit). 1 = a unit per layer;
            more trades peak memory (that many layers' unsharded parameters) for fewer, larger
            collectives and less host time per step (what small, host-bound layers need).
        param_dtype: FSDP mixed precision compute dtype (``bfloat16``, ``float16``, ``float32``).
        reduce_dtype: FSDP gradient reduction dtype.
        activation_checkpointing: Checkpointing policy for decoder layers.
        compile: ``torch.compile`` each decoder layer (in place; parameter names unchanged).
        context_parallel_attention: How attention crosses the context group when the sequence is
            sharded (context parallelism): ``allgather`` (all-gather K/V, one fused attention call)
            or ``ring`` (K/V blocks passed around the group, overlapped with block compute). See
            :mod:`plait.models.blocks.context_parallel`.
        expert_dispatch: How MoE tokens reach their experts when the expert mesh's ``ep_shard`` dim
            is > 1: ``all_to_all`` (``torch.distributed``, NCCL or gloo; the split sizes are read on
            the host, a sync per MoE layer), ``all_gather`` (tokens all-gathered over the EP group
            and expert outputs reduce-scattered: every size stays on the device, so the host never
            waits and a compiled MoE layer is one graph; ``(P-1) * T`` rows each way, fewer bytes
            than the all-to-all when ``P`` is below top-k; ``plait.moe.AllGatherDispatcher``) or
            ``deepep`` (DeepEP's normal-mode NVLink/RDMA kernels, CUDA only; needs ``pip install
            "plait-moe[deepep]"``, else applying the plan raises an ``ImportError`` naming that extra).
            Without expert parallelism every expert is local and none is used.
        expert_chunks: ``all_to_all`` and ``all_gather``: token chunks pipelined so that the
            exchanges overlap the expert GEMMs (the dispatcher's ``num_chunks``; 1 = no overlap;
            None = 1; ``deepep`` refuses it).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    data_parallel: Literal["fsdp", "none"] = "fsdp"
    reshard_after_forward: bool | None = None
    fsdp_layers_per_unit: int = Field(default=1, ge=1)
    param_dtype: Literal["bfloat16", "float16", "float32"] | None = None
    reduce_dtype: Literal["bfloat16", "float16", "float32"] | None = None
    activation_checkpointing: ActivationCheckpointing = ActivationCheckpointing()
    compile: bool = False
    context_parallel_attention: Literal["ring", "allgather"] = "allgather"
    expert_dispatch: Literal["all_to_all", "all_gather", "deepep"] = "all_to_all"
    expert_chunks: int | None = Field(default=None, ge=1)
