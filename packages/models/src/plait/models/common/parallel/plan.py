"""Parallel plans for decoder stages: float8, TP, CP, EP, FSDP2/HSDP, activation checkpointing, compile.

A family's ``parallelize`` is :func:`parallelize_decoder` with the family's tensor-parallel plan of
one layer (:func:`tp_gqa_layer` for grouped-query attention with SwiGLU MLPs).

Order matters and follows torchtitan: float8 conversion of the linears first (the later plans
then act on the converted modules), tensor parallel (parameters become DTensors on the
``tp`` mesh), context parallel (attention and MoE balancing losses span the context group), then
expert parallel (expert weights ``Shard(0)`` over ``ep_shard``), activation
checkpointing and compile (in place, parameter names unchanged), and FSDP2 last (per decoder
layer, then the root), so that FSDP shards the TP/EP DTensors as 2-D parameters.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, cast

import torch.distributed as dist
from plait.dist_core import DistributedContext, fsdp_copy_in, parse_dtype
from plait.dist_core.fsdp_state import keep_unsharded_storage
from plait.dist_core.fsdp_symmetric import symmetric_memory_unavailable, use_symmetric_all_gather
from plait.models.common.attention import ContextParallel, ContextParallelMode, GroupedQueryAttention
from plait.models.common.layer import DecoderLayer, SequentialMixer
from plait.models.common.model import CausalLMStage, DecoderStage
from plait.models.common.parallel.activation_checkpointing import apply_activation_checkpointing
from plait.models.common.parallel.config import ParallelConfig
from plait.models.common.parallel.float8 import apply_float8
from plait.moe import ExpertDispatch, MoELayer
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

__all__ = [
    "LayerTensorParallel",
    "apply_context_parallel",
    "apply_expert_parallel",
    "apply_fsdp",
    "apply_tensor_parallel",
    "check_context_parallel",
    "parallelize_decoder",
    "tp_gqa_layer",
]

LayerTensorParallel = Callable[[DecoderLayer, DeviceMesh], None]


def _dim_size(mesh: DeviceMesh | None, name: str) -> int:
    if mesh is None or mesh.mesh_dim_names is None or name not in mesh.mesh_dim_names:
        return 1
    return int(mesh[name].size())


def dense_mlp_plan(layer: DecoderLayer) -> dict[str, Any]:
    """The tensor-parallel plan of a dense SwiGLU MLP (gate/up column-parallel, down row-parallel);
    empty for a MoE layer (its experts run replicated over ``tp``)."""
    if layer.is_moe:
        return {}
    return {
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(),
    }


def tp_gqa_layer(layer: DecoderLayer, tp_mesh: DeviceMesh) -> None:
    """Megatron-style tensor parallelism of one layer with :class:`GroupedQueryAttention`.

    q/k/v column-parallel (heads split), o row-parallel; q/k RMSNorm weights stay replicated with
    their gradients summed over ``tp``; sink logits sharded by head. Dense SwiGLU MLPs: gate/up
    column-parallel, down row-parallel. MoE blocks are not tensor-parallel (they run replicated
    over ``tp``; shard them with expert parallelism).
    """
    attn = layer.self_attn
    assert isinstance(attn, GroupedQueryAttention)
    plan: dict[str, Any] = {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(),
    }
    plan.update(dense_mlp_plan(layer))
    parallelize_module(layer, tp_mesh, plan)
    for norm in (attn.q_norm, attn.k_norm):
        if norm is not None:
            norm.grad_reduce_group = tp_mesh.get_group()
    if attn.sinks is not None:
        attn.sinks = nn.Parameter(distribute_tensor(attn.sinks.data, tp_mesh, [Shard(0)]))


def apply_tensor_parallel(
    model: DecoderStage, tp_mesh: DeviceMesh, layer_plan: LayerTensorParallel = tp_gqa_layer
) -> None:
    """Tensor parallelism over ``tp_mesh`` (1-D): ``layer_plan`` for each decoder layer, the
    embedding vocab-parallel (row-wise, masked lookup + all-reduce), the LM head a vocab-sharded
    weight with a vocab-parallel cross-entropy.

    Raises:
        ValueError: if heads, KV heads, intermediate or vocab sizes are not divisible by ``tp``.
    """
    cfg = model.config
    tp = tp_mesh.size()
    for name, value in (
        ("num_attention_heads", cfg.num_attention_heads),
        ("num_key_value_heads", cfg.kv_heads),
        ("intermediate_size", cfg.intermediate_size),
        ("vocab_size", cfg.vocab_size),
    ):
        if value % tp:
            raise ValueError(f"tensor parallel size {tp} does not divide config.{name}={value}")
    for layer in model.decoder_layers():
        layer_plan(layer, tp_mesh)
    if model.model.embed_tokens is not None:
        parallelize_module(
            model.model.embed_tokens,
            tp_mesh,
            RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate(), use_local_output=True),
        )
    if isinstance(model, CausalLMStage) and model.lm_head is not None:
        head = model.lm_head
        if cfg.tie_word_embeddings and model.model.embed_tokens is not None:
            model.tie_weights()
        else:
            head.weight = nn.Parameter(distribute_tensor(head.weight.data, tp_mesh, [Shard(0)]))
        head.tp_group = tp_mesh.get_group()


def check_context_parallel(model: DecoderStage, cp: int) -> None:
    """Refuse context parallelism over ``cp`` ranks for a stage with a layer it cannot run.

    Raises:
        ValueError: naming the first layer whose token mixer is a :class:`SequentialMixer` and its
            layer type (e.g. ``linear_attention``).
    """
    for layer in model.decoder_layers():
        mixer = layer.self_attn
        if isinstance(mixer, SequentialMixer):
            raise ValueError(
                f"context parallelism (mesh.context={cp}) is not supported by layer {layer.layer_idx}: "
                f"its layer type {mixer.layer_type!r} ({type(mixer).__name__}) carries a recurrent "
                "state along the sequence, which context parallelism splits over ranks; use mesh.context=1"
            )


def apply_context_parallel(
    model: DecoderStage, cp_mesh: DeviceMesh, mode: ContextParallelMode = "allgather"
) -> None:
    """Context parallelism over ``cp_mesh`` (1-D): the model takes sequence shards in the
    load-balanced layout (:func:`plait.dist_core.shard_batch`), attention crosses the group
    (``mode``: ``allgather`` or ``ring``) and MoE balancing losses sum their statistics over it.

    Parameters stay as they are: their gradients must be summed over the context group too (FSDP
    over the dense mesh's ``dp_cp_shard`` does that).

    Raises:
        ValueError: the stage is not a causal LM (pooling heads need the whole sequence), or a
            layer's token mixer carries a state along the sequence (:class:`SequentialMixer`).
    """
    check_context_parallel(model, cp_mesh.size())
    if not isinstance(model, CausalLMStage):
        raise ValueError(
            f"context parallelism supports causal-LM stages, not {type(model).__name__} "
            "(its pooling head needs the whole sequence on one rank)"
        )
    group = cp_mesh.get_group()
    model.model.context_parallel = ContextParallel(group, mode)
    for moe in model.moe_layers():
        moe.router.context_group = group


def apply_expert_parallel(
    model: DecoderStage,
    ep_mesh: DeviceMesh,
    dispatch: ExpertDispatch = "all_to_all",
    num_chunks: int | None = None,
    buffer_factor: float | None = None,
) -> None:
    """Shard every MoE layer's experts over ``ep_mesh`` (1-D) with ``plait.moe.expert_parallel``.

    Args:
        model: The stage, modified in place.
        ep_mesh: The expert-parallel mesh dimension (``ep_shard``).
        dispatch: Token dispatch backend (``ParallelConfig.dispatch``).
        num_chunks: overlap chunks of the ``all_to_all`` / ``all_gather`` dispatch
            (``ParallelConfig.expert_chunks``; None = 1).
        buffer_factor: the ``all_gather`` dispatch's expert buffer, in multiples of balanced
            routing's rows (``ParallelConfig.expert_buffer_factor``; None = the exact bound).

    Raises:
        ImportError: ``dispatch="deepep"`` without DeepEP installed (names ``plait-moe[deepep]``).
        ValueError: ``num_chunks`` set with ``dispatch="deepep"``, ``buffer_factor`` with another
            dispatch than ``"all_gather"``.
    """
    from plait.moe import expert_parallel

    for moe in model.moe_layers():
        expert_parallel(moe, ep_mesh, backend=dispatch, num_chunks=num_chunks, buffer_factor=buffer_factor)


def apply_fsdp(
    model: DecoderStage,
    dp_mesh: DeviceMesh,
    *,
    experts_sharded: bool = False,
    expert_dp_mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
    layers_per_unit: int = 1,
    cuda_graphs: bool = False,
    shard_embedding_rows: bool = False,
    symmetric_memory: bool | None = None,
) -> None:
    """FSDP2 per group of ``layers_per_unit`` consecutive decoder layers, on the token embedding, on the
    LM head (kept gathered from its forward to its backward; both in the root's unit when tied) and on
    the root, over ``dp_mesh`` (1-D = FSDP, 2-D = HSDP).

    With ``cuda_graphs`` (the layers replayed as CUDA graphs, which read their parameters at the addresses
    they were recorded with) every layer keeps its gathered parameters allocated when it reshards
    (:func:`plait.dist_core.fsdp_state.keep_unsharded_storage`: each all-gather writes the same addresses,
    for the memory of the unsharded layers held all the time) and from its forward to its backward
    (``reshard_after_forward`` unset means False; True, which would free nothing and only gather again in
    the backward, is refused).

    With ``shard_embedding_rows`` the token embedding is no unit: its rows stay sharded over ``dp_mesh``
    (:meth:`TokenEmbedding.shard_rows`, ``ParallelConfig.shard_embedding_rows``; a 1-D mesh, untied).

    ``symmetric_memory`` (``ParallelConfig.fsdp_symmetric_memory``): the units over ``dp_mesh`` gather into
    NCCL symmetric memory (:mod:`plait.dist_core.fsdp_symmetric`); None = where the group supports it (one
    group per process), not with ``cuda_graphs`` and within one node, True = required. The experts' units
    over ``expert_dp_mesh`` keep the default all-gather.

    With ``experts_sharded`` (expert parallelism applied), expert weights are left out of the dense
    ``fully_shard`` calls; with ``expert_dp_mesh`` (the expert domain's ``ep_replicate`` dim) they
    get their own ``fully_shard`` (one per layer) so their gradients are reduced over the expert
    replicas.
    """
    if cuda_graphs:
        if reshard_after_forward:
            raise ValueError(
                "parallel.reshard_after_forward=true frees nothing under parallel.cuda_graphs (FSDP keeps the "
                "layers' unsharded parameters at fixed addresses for the graphs) and would all-gather them "
                "again in the backward; leave it unset or false"
            )
        reshard_after_forward = False
    fsdp_copy_in.install()
    kwargs: dict[str, Any] = {}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    if reshard_after_forward is not None:
        kwargs["reshard_after_forward"] = reshard_after_forward
    layers = list(model.decoder_layers())
    ignored_all: set[nn.Parameter] = set()
    expert_units: list[nn.Module] = []
    for start in range(0, len(layers), layers_per_unit):
        unit = layers[start : start + layers_per_unit]
        ignored: set[nn.Parameter] = set()
        for layer in unit:
            if isinstance(layer.mlp, MoELayer) and experts_sharded:
                experts = layer.mlp.experts
                if expert_dp_mesh is not None:
                    fully_shard(experts, mesh=expert_dp_mesh, **kwargs)
                    expert_units.append(experts)
                else:
                    ignored |= set(experts.parameters())
        ignored_all |= ignored
        if len(unit) == 1:
            fully_shard(unit[0], mesh=dp_mesh, ignored_params=ignored or None, **kwargs)
        else:
            fully_shard(list[nn.Module](unit), mesh=dp_mesh, ignored_params=ignored or None, **kwargs)
    ignored_all |= _shard_ends(model, dp_mesh, kwargs, shard_embedding_rows)
    fully_shard(model, mesh=dp_mesh, ignored_params=ignored_all or None, **kwargs)
    if _symmetric(symmetric_memory, dp_mesh, cuda_graphs):
        experts_ids = {id(e) for e in expert_units}
        for module in model.modules():
            if isinstance(module, FSDPModule) and id(module) not in experts_ids:
                use_symmetric_all_gather(module)
    if cuda_graphs:
        for layer in layers:
            keep_unsharded_storage(cast(FSDPModule, layer))


def _symmetric(setting: bool | None, dp_mesh: DeviceMesh, cuda_graphs: bool) -> bool:
    """Whether FSDP2's all-gathers over ``dp_mesh``'s shard dim go into symmetric memory
    (``ParallelConfig.fsdp_symmetric_memory``; True where it cannot be is an error naming why). By default
    not under CUDA graphs, where it is not verified (``packages/models/README.md``), and not over several
    nodes (measured on one host only)."""
    group = dp_mesh.get_group(dp_mesh.ndim - 1)
    if setting is False or group.size() == 1:  # one rank gathers nothing
        return False
    world = dist.get_world_size()
    if setting is None and int(os.environ.get("LOCAL_WORLD_SIZE", world)) < world:  # several nodes
        return False
    why = symmetric_memory_unavailable(group)
    if why is None and cuda_graphs:
        why = "it is not verified under parallel.cuda_graphs (set one of them to false)"
    if why is not None and setting:
        raise ValueError(f"parallel.fsdp_symmetric_memory = true, but {why}")
    return why is None


def _shard_ends(
    model: DecoderStage, dp_mesh: DeviceMesh, kwargs: dict[str, Any], shard_embedding_rows: bool
) -> set[nn.Parameter]:
    """FSDP2 units of the stage's token embedding and LM head (none when they share one weight: both stay
    in the root's unit); with ``shard_embedding_rows`` the embedding's rows are sharded instead. Returns
    the parameters the root's unit must leave alone.

    In units of their own (as torchtitan shards them) the head's all-gather runs under the last layers'
    forward and its reduce-scatter under the layers' backward; in the root's unit both would wait with
    the embedding's at the step's two ends. The head's backward follows its forward at once, so it
    never reshards in between (that would only gather it again)."""
    embed = model.model.embed_tokens
    head = getattr(model, "lm_head", None)
    tied = embed is not None and head is not None and head.weight is embed.weight
    if tied and shard_embedding_rows:
        raise ValueError(
            "parallel.shard_embedding_rows needs the token embedding apart from the LM head "
            "(tie_word_embeddings = false): a tied table is gathered for the head"
        )
    if tied:
        return set()
    if head is not None:
        fully_shard(head, mesh=dp_mesh, **{**kwargs, "reshard_after_forward": False})
        register_fsdp_forward_method(head, "loss")  # the stage calls its loss, not its forward
    if embed is None:
        return set()
    if not shard_embedding_rows:
        fully_shard(embed, mesh=dp_mesh, **kwargs)
        return set()
    mp = kwargs.get("mp_policy")
    embed.shard_rows(dp_mesh, mp.param_dtype if mp is not None else None)
    return {cast(nn.Parameter, embed.weight)}


def _check_cuda_graph_layout(
    dense_mesh: DeviceMesh | None,
    expert_mesh: DeviceMesh | None,
    cp_mesh: DeviceMesh | None,
    expert_dispatch: str,
) -> None:
    """``ParallelConfig.cuda_graphs`` needs one stage per process, no collective inside a layer other than
    the ``all_gather`` expert dispatch's, and no host synchronisation (see its docstring)."""
    sizes = {
        "mesh.pipeline": _dim_size(dense_mesh, "pp"),
        "mesh.tensor": _dim_size(dense_mesh, "tp"),
        "mesh.context": cp_mesh.size() if cp_mesh is not None else 1,
    }
    if used := [f"{name}={n}" for name, n in sizes.items() if n > 1]:
        raise ValueError(
            "parallel.cuda_graphs needs one stage per process and no collective inside a layer but the "
            f"expert dispatch's (data and expert parallelism only); this layout has {', '.join(used)} "
            "(set parallel.cuda_graphs=false for it)"
        )
    if (ep := _dim_size(expert_mesh, "ep_shard")) > 1 and expert_dispatch != "all_gather":
        raise ValueError(
            f"parallel.cuda_graphs with expert parallelism (mesh.expert={ep}) needs "
            f"parallel.expert_dispatch='all_gather' (every size on the device); "
            f"{expert_dispatch!r} synchronises with the host inside the layer (or set parallel.cuda_graphs=false)"
        )


def apply_data_parallel(
    model: DecoderStage,
    dense_mesh: DeviceMesh,
    config: ParallelConfig,
    *,
    expert_mesh: DeviceMesh | None = None,
    experts_sharded: bool = False,
) -> None:
    """FSDP2 (HSDP with ``dp_replicate`` > 1) over the dense mesh's data ranks (its ``dp_cp_shard`` dim, of
    any size: one rank too), as ``config`` says (units, resharding, mixed precision); the last step of
    :func:`parallelize_decoder`."""
    if _dim_size(dense_mesh, "dp_replicate") > 1:
        # HSDP; with dp_cp_shard of size 1 this is plain replication (DDP semantics).
        dp_mesh = dense_mesh["dp_replicate", "dp_cp_shard"]
    else:
        dp_mesh = dense_mesh["dp_cp_shard"]
    mp = None
    if config.param_dtype or config.reduce_dtype:
        mp = MixedPrecisionPolicy(
            param_dtype=parse_dtype(config.param_dtype) if config.param_dtype else None,
            reduce_dtype=parse_dtype(config.reduce_dtype) if config.reduce_dtype else None,
        )
    ep_rep = None
    if experts_sharded and _dim_size(expert_mesh, "ep_replicate") > 1:
        assert expert_mesh is not None
        ep_rep = expert_mesh["ep_replicate"]
    apply_fsdp(
        model,
        dp_mesh,
        experts_sharded=experts_sharded,
        expert_dp_mesh=ep_rep,
        reshard_after_forward=config.reshard_after_forward,
        mp_policy=mp,
        layers_per_unit=config.fsdp_layers_per_unit,
        cuda_graphs=config.cuda_graphs,
        shard_embedding_rows=config.shard_embedding_rows,
        symmetric_memory=config.fsdp_symmetric_memory,
    )


def parallelize_decoder(
    model: DecoderStage,
    *,
    layer_plan: LayerTensorParallel = tp_gqa_layer,
    dense_mesh: DeviceMesh | None = None,
    expert_mesh: DeviceMesh | None = None,
    config: ParallelConfig | None = None,
    context: DistributedContext | None = None,
    cp_mesh: DeviceMesh | None = None,
) -> DecoderStage:
    """Apply float8, TP, CP, EP, activation checkpointing, compile and FSDP2/HSDP to a stage, in place.

    Pass either the meshes or a :class:`~plait.dist_core.DistributedContext` (``context``), whose
    ``mesh_for("dense")`` (dims ``pp, dp_replicate, dp_cp_shard, cp_replicate, tp``),
    ``mesh_for("expert")`` (dims ``pp, ep_replicate, ep_shard``) and the ``cp`` dim of
    ``mesh_for("batch")`` are used. Dims of size 1 are skipped. Call on the meta-device model
    before ``to_empty`` + ``reset_parameters`` (or before loading a checkpoint).

    Under context parallelism (a ``cp`` group of size > 1) every input of the model must be this
    rank's shard in the load-balanced layout (:func:`plait.dist_core.shard_batch`); FSDP shards
    over ``dp_cp_shard``, which sums the gradients over the context ranks too.

    Args:
        model: A decoder stage (a family's causal LM or sequence classifier).
        layer_plan: The family's tensor-parallel plan of one decoder layer.
        dense_mesh: Mesh of the dense domain.
        expert_mesh: Mesh of the expert domain.
        config: Parallel settings (default: FSDP, no checkpointing, no compile).
        context: A DistributedContext (alternative to the meshes).
        cp_mesh: 1-D context-parallel mesh (with ``dense_mesh``; from ``context`` otherwise). Its
            ranks must be those of the ``dp_cp_shard`` dim that share a data shard.

    Returns:
        The same module.

    Raises:
        ValueError: ``context_replicate > 1`` with FSDP (use ``context_shard``), context
            parallelism for a classifier stage or a stage with a :class:`SequentialMixer` layer
            (e.g. ``linear_attention``), or ``config.cuda_graphs`` with pipeline, tensor or context
            parallelism, expert parallelism by another dispatch than ``all_gather``, or FSDP and
            ``reshard_after_forward=True``.
        ImportError: ``config.float8`` set without torchao (names ``plait-models[float8]``).
        RuntimeError: ``config.float8`` set without a float8-capable GPU (compute capability 8.9+).
    """
    config = config or ParallelConfig()
    if context is not None:
        dense_mesh = dense_mesh or context.mesh_for("dense")
        expert_mesh = expert_mesh or context.mesh_for("expert")
        cp_mesh = cp_mesh or context.mesh_for("batch")["cp"]
    dp = _dim_size(dense_mesh, "dp_replicate") * _dim_size(dense_mesh, "dp_cp_shard")
    fsdp = config.data_parallel == "fsdp" and dp > 1
    if cp_mesh is not None and cp_mesh.size() > 1:
        check_context_parallel(model, cp_mesh.size())  # before any plan changes the model
    if config.cuda_graphs:
        _check_cuda_graph_layout(dense_mesh, expert_mesh, cp_mesh, config.dispatch)
    apply_float8(model, config.float8, fsdp=fsdp, compile=config.compile)
    if _dim_size(dense_mesh, "tp") > 1:
        assert dense_mesh is not None
        apply_tensor_parallel(model, dense_mesh["tp"], layer_plan)
    if cp_mesh is not None and cp_mesh.size() > 1:
        if config.data_parallel == "fsdp" and _dim_size(dense_mesh, "cp_replicate") > 1:
            raise ValueError(
                "context_replicate > 1 is not supported with data_parallel='fsdp' (FSDP2 would not "
                "reduce gradients over it); use context_shard"
            )
        apply_context_parallel(model, cp_mesh, config.context_parallel_attention)
    experts_sharded = _dim_size(expert_mesh, "ep_shard") > 1 and bool(model.moe_layers())
    if experts_sharded:
        assert expert_mesh is not None
        apply_expert_parallel(
            model,
            expert_mesh["ep_shard"],
            config.dispatch,
            config.expert_chunks,
            config.expert_buffer_factor,
        )
    layers = {layer.layer_idx: layer for layer in model.decoder_layers()}
    apply_activation_checkpointing(dict(layers), config.activation_checkpointing)
    if config.compile:
        for layer in layers.values():
            layer.compile(mode="reduce-overhead" if config.cuda_graphs else None)
        model.model.cuda_graphs = config.cuda_graphs
        model.model.kernels.static_captures = config.cuda_graphs
    if fsdp:
        assert dense_mesh is not None
        apply_data_parallel(
            model, dense_mesh, config, expert_mesh=expert_mesh, experts_sharded=experts_sharded
        )
    return model
