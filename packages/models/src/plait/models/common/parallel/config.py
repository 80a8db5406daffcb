"""Parallelisation settings for plait models."""

from __future__ import annotations

from typing import Literal

from plait.moe import ExpertDispatch
from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["ActivationCheckpointing", "Float8Training", "ParallelConfig"]


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

    mode: Literal["none", "full", "selective"] = Field(
        default="none",
        description="none; full (recompute the whole layer in backward); selective (keep save_ops outputs).",
    )
    every: int = Field(
        default=1, ge=1, description="Checkpoint every k-th decoder layer (global index % k == 0)."
    )
    save_ops: tuple[str, ...] = Field(
        default=(
            "aten.mm.default",
            "aten.addmm.default",
            "aten.bmm.default",
            "aten._scaled_mm.default",  # float8 linears (ParallelConfig.float8)
            "aten._scaled_dot_product_efficient_attention.default",
            "aten._scaled_dot_product_flash_attention.default",
            "aten._scaled_dot_product_flash_attention_for_cpu.default",
            "aten._scaled_dot_product_cudnn_attention.default",
            "aten._flash_attention_forward.default",
            "aten._efficient_attention_forward.default",
            "flex_attention",  # FlexAttention's higher-order op (packed documents, windows, sinks on a GPU)
            "aten._grouped_mm.default",
            "plait.gmm.default",
            "_c10d_functional.reduce_scatter_tensor.default",
            "_c10d_functional.all_to_all_single.default",
        ),
        description="selective only: ops (e.g. aten.mm.default) whose outputs are kept, not recomputed.",
    )


class Float8Training(BaseModel):
    """FP8 training of the decoder layers' linear layers with torchao float8
    (``pip install "plait-models[float8]"``; NVIDIA compute capability 8.9+: Ada, Hopper, Blackwell).

    Converted: every ``nn.Linear`` inside a decoder layer (attention projections, dense and shared-expert
    MLP projections) whose two dimensions are multiples of 16 (the float8 GEMMs' requirement; others
    are skipped and listed). With ``experts``, also the routed experts' two grouped GEMMs. Kept in
    high precision: the embedding, the LM head and routers.

    Attributes:
        recipe: ``None`` (off); ``tensorwise`` (one dynamic scale per tensor, the fastest); ``rowwise``
            (one scale per row, power-of-two scales: more robust to outliers);
            ``rowwise_with_gw_hp`` (rowwise, the weight gradient in high precision). torchao's
            ``Float8LinearConfig.from_recipe_name``.
        fsdp_float8_all_gather: ``tensorwise`` with FSDP2 only: all-gather the weights in float8 (half
            the bytes of bf16), their scales precomputed after each optimizer step with one
            all-reduce. None = on for ``tensorwise`` (where FSDP shards the model), off otherwise.
        experts: Also run the routed experts' grouped GEMMs (forward and both backward GEMMs) in
            float8 with rowwise scales (torchao's float8 grouped GEMM, whatever ``recipe`` says; its
            token groups are padded to multiples of 16 rows). Off by default: on the 1.14B MoE
            benchmark (hidden 1024, expert width 512, 64 experts) the compiled Trainer ran at 0.55x
            of bf16's tok/s with it (``benchmarks/results/families.md``): at these widths the casts
            and the padding copies cost more than the float8 tensor cores save. Not with
            ``emulate`` (no emulated grouped GEMM).
        skip: Module-name substrings (``"k_proj"``, ``"layers.0."``) of linears (and experts) to keep
            in high precision.
        emulate: Emulated float8 GEMMs (values rounded to float8, the product in fp32): runs on any
            device, including CPU, with no speed-up. For tests only.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    recipe: Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"] | None = Field(
        default=None,
        description="torchao float8 recipe: tensorwise, rowwise or rowwise_with_gw_hp (None: float8 off).",
    )
    fsdp_float8_all_gather: bool | None = Field(
        default=None,
        description="tensorwise with FSDP2: all-gather weights in float8 (None: on for tensorwise).",
    )
    experts: bool = Field(
        default=False,
        description="Also run the routed experts' grouped GEMMs in float8 (rowwise; not with emulate).",
    )
    skip: tuple[str, ...] = Field(
        default=(), description="Module-name substrings of linears (and experts) kept in high precision."
    )
    emulate: bool = Field(
        default=False, description="Emulated float8 GEMMs on any device (CPU too), no speed-up; for tests."
    )

    @model_validator(mode="after")
    def _consistent(self) -> Float8Training:
        if self.fsdp_float8_all_gather and self.recipe != "tensorwise":
            raise ValueError(
                "parallel.float8.fsdp_float8_all_gather needs recipe = 'tensorwise' (torchao all-gathers "
                f"float8 weights only with tensorwise scales), got recipe = {self.recipe!r}"
            )
        if self.experts and self.emulate:
            raise ValueError(
                "parallel.float8.experts needs float8 grouped GEMMs on a GPU; emulate = true has none"
            )
        return self

    @property
    def enabled(self) -> bool:
        """Whether any linear is converted."""
        return self.recipe is not None


class ParallelConfig(BaseModel):
    """How :func:`plait.models.parallelize` distributes a model.

    Attributes:
        data_parallel: ``fsdp`` shards parameters over the dense mesh's ``dp_cp_shard`` dim and
            replicates over ``dp_replicate`` (HSDP when both > 1; plain replication when only
            ``dp_replicate`` > 1); ``none`` leaves gradient synchronisation to the caller.
        reshard_after_forward: FSDP2 ``reshard_after_forward`` (None: FSDP's default) of every unit but
            the LM head's (kept gathered for its backward, which follows at once).
        fsdp_layers_per_unit: Consecutive decoder layers that share one FSDP2 unit (one
            all-gather, one reduce-scatter and one set of hooks per unit). 1 = a unit per layer;
            more trades peak memory (that many layers' unsharded parameters) for fewer, larger
            collectives and less host time per step (what small, host-bound layers need).
        shard_embedding_rows: Under FSDP, the token embedding is no FSDP2 unit: its rows stay sharded over
            the data-parallel ranks and each lookup exchanges the tokens' vectors instead
            (:meth:`plait.models.common.heads.TokenEmbedding.shard_rows`): no all-gather of the table at
            the forward's start and no reduce-scatter of its gradient at the backward's end, where no
            compute hides them, and no gathered table in memory. Every data-parallel rank must pass the
            same number of tokens in every forward (packed or fixed-length batches; checked on the device).
            Needs an untied embedding, a 1-D FSDP mesh (no HSDP) and no tensor parallelism.
        fsdp_symmetric_memory: FSDP2's all-gathers of the dense units into NCCL symmetric memory
            (:mod:`plait.dist_core.fsdp_symmetric`: NCCL's symmetric kernels, fewer SMs taken from the
            compute beside them). None: on wherever the data-parallel group is NCCL, torch and NCCL
            support it, ``cuda_graphs`` is off (not verified with graphs), the job runs on one node
            (measured on one host only) and the process gathers into symmetric memory over no other group
            (one per process: torch keys its registrations by group name, and groups made again get the old
            names back); true: required (an error says why it cannot be); false: off.
        param_dtype: FSDP mixed precision compute dtype (``bfloat16``, ``float16``, ``float32``).
        reduce_dtype: FSDP gradient reduction dtype.
        activation_checkpointing: Checkpointing policy for decoder layers.
        float8: FP8 training of the decoder layers' linears (torchao float8; off by default). Applied
            first, before tensor parallelism, so that the plan's hooks land on the converted modules.
        compile: ``torch.compile`` each decoder layer (in place; parameter names unchanged).
        cuda_graphs: With ``compile``, each compiled decoder layer's forward and backward are also
            captured as CUDA graphs (inductor's CUDA-graph trees, ``mode="reduce-overhead"``) and
            replayed: a launch per graph instead of one per kernel, meant for host-bound steps. One
            stage per process and no host synchronisation inside a layer: pipeline stages, tensor and
            context parallelism are refused, and expert parallelism with an ``expert_dispatch`` other
            than ``all_gather`` (the default under graphs; its collectives are then captured in the
            graphs; the process groups' teardown frees the graphs first:
            :func:`plait.dist_core.release_cuda_graphs`). Data parallelism
            (FSDP2/HSDP) is allowed: each layer then keeps its gathered parameters allocated at fixed
            addresses (the memory of the unsharded layers, held all the time; every all-gather writes them
            there) and from its forward to its backward (``reshard_after_forward`` unset means False; True
            is refused), and its buffers are static graph inputs. Gradients accumulate over microbatches:
            torch's graph trees hand the layers' weight gradients out of their memory pool, which the next
            replay overwrites, so each training forward hooks the parameters each layer holds after its
            forward to copy the first gradient of a step out of the pool
            (:func:`plait.models.common.model.own_graph_gradients`). CUDA only. Off by default; it pays
            where the step is host-bound (a 0.6B Llama trained 1.6-1.8x faster with it at 2048 tokens per
            microbatch, alike from 8k; the one-GPU MoE main job 1.15x; the 1.14B MoE Trainer row over 2
            GPUs 1.19-1.48x under EP=2 x FSDP2, and under FSDP2 1.13-1.23x while the LM head shared the
            root's FSDP unit, no change since it has its own), and ``gpu2.toml`` ships it
            (``benchmarks/results/cuda_graphs.md``, ``scaling.md``).
        context_parallel_attention: How attention crosses the context group when the sequence is
            sharded (context parallelism): ``allgather`` (all-gather K/V, one fused attention call)
            or ``ring`` (K/V blocks passed around the group, overlapped with block compute). See
            :mod:`plait.models.blocks.context_parallel`.
        expert_dispatch: How MoE tokens reach their experts when the expert mesh's ``ep_shard`` dim
            is > 1 (None, the default: ``all_gather`` with ``cuda_graphs``, the only one a graph captures,
            else ``all_to_all``; :attr:`dispatch` is the one used): ``all_to_all`` (``torch.distributed``,
            NCCL or gloo; the split sizes are read on the host, a sync per MoE layer), ``all_gather``
            (tokens all-gathered over the EP group and expert outputs reduce-scattered: every size stays on
            the device, so the host never waits and a compiled MoE layer is one graph; ``(P-1) * T`` rows
            each way, fewer bytes than the all-to-all when ``P`` is below top-k;
            ``plait.moe.AllGatherDispatcher``) or
            ``deepep`` (DeepEP's normal-mode NVLink/RDMA kernels, CUDA only; needs ``pip install
            "plait-moe[deepep]"``, else applying the plan raises an ``ImportError`` naming that extra).
            Without expert parallelism every expert is local and none is used.
        expert_chunks: ``all_to_all`` and ``all_gather``: token chunks pipelined so that the
            exchanges overlap the expert GEMMs (the dispatcher's ``num_chunks``; 1 = no overlap;
            None = 1; ``deepep`` refuses it).
        expert_buffer_factor: ``all_gather`` only: each rank's permuted expert buffer holds this
            many times the rows its experts get when the routing is balanced (``T * k``), instead of
            the exact bound ``P * T * k`` that no routing can overflow; the expert activations and
            their elementwise work then scale with the factor instead of the EP size ``P``. A step
            whose routing sends more assignments to a rank's experts stops with a device-side assert
            naming this key (raise it, or None); nothing is dropped. No constant is safe for every
            model (2 overflowed at EP 4 in the first steps of a 1.14B MoE with a weak aux loss): size
            it from the busiest rank's measured share. None = the exact bound.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    data_parallel: Literal["fsdp", "none"] = Field(
        default="fsdp",
        description="fsdp: FSDP2 (HSDP with data_replicate > 1) when data-parallel; none: the caller's.",
    )
    reshard_after_forward: bool | None = Field(
        default=None,
        description="FSDP2's reshard_after_forward (None: FSDP2's default) of every unit but the LM head's, "
        "which keeps its parameters gathered for its backward (it follows at once).",
    )
    fsdp_layers_per_unit: int = Field(
        default=1,
        ge=1,
        description="Consecutive decoder layers sharing one FSDP2 unit (all-gather, reduce-scatter).",
    )
    shard_embedding_rows: bool = Field(
        default=False,
        description="FSDP: keep the token embedding's rows sharded and exchange the looked-up vectors "
        "instead of gathering the table (equal token counts on every data rank; untied, no HSDP or TP).",
    )
    fsdp_symmetric_memory: bool | None = Field(
        default=None,
        description="FSDP2's all-gathers into NCCL symmetric memory (None: wherever NCCL and torch "
        "support it, on one node, not with cuda_graphs, over one process group per process; true: required; "
        "false: off).",
    )
    param_dtype: Literal["bfloat16", "float16", "float32"] | None = Field(
        default=None, description="FSDP mixed-precision compute dtype (None: the parameters' own dtype)."
    )
    reduce_dtype: Literal["bfloat16", "float16", "float32"] | None = Field(
        default=None, description="FSDP gradient reduce-scatter dtype (None: the compute dtype)."
    )
    activation_checkpointing: ActivationCheckpointing = ActivationCheckpointing()
    float8: Float8Training = Float8Training()
    compile: bool = Field(default=False, description="torch.compile each decoder layer.")
    cuda_graphs: bool = Field(
        default=False,
        description=(
            "With compile: replay each layer as CUDA graphs (CUDA; one stage per process; FSDP, and EP with "
            "the all_gather dispatch, allowed), for host-bound steps."
        ),
    )
    context_parallel_attention: Literal["ring", "allgather"] = Field(
        default="allgather",
        description="Attention over a sharded sequence: allgather (all-gather K/V) or ring (K/V blocks).",
    )
    expert_dispatch: ExpertDispatch | None = Field(
        default=None,
        description="How MoE tokens reach experts with expert parallelism: all_to_all, all_gather, deepep "
        "(None: all_gather with cuda_graphs, which capture only it, else all_to_all).",
    )
    expert_chunks: int | None = Field(
        default=None,
        ge=1,
        description="all_to_all/all_gather: token chunks overlapping exchanges with expert GEMMs (None: 1).",
    )
    expert_buffer_factor: float | None = Field(
        default=None,
        ge=1.0,
        allow_inf_nan=False,
        description="all_gather: expert buffer rows as a multiple of balanced routing's; overflow "
        "stops the step (None: exact P*T*k bound).",
    )

    @property
    def dispatch(self) -> ExpertDispatch:
        """The expert dispatch used: ``expert_dispatch``, or where unset ``all_gather`` under ``cuda_graphs``
        (the one a graph captures) and ``all_to_all`` otherwise."""
        return self.expert_dispatch or ("all_gather" if self.cuda_graphs else "all_to_all")

    @model_validator(mode="after")
    def _buffer_factor_needs_all_gather(self) -> ParallelConfig:
        if self.expert_buffer_factor is not None and self.dispatch != "all_gather":
            raise ValueError(
                "parallel.expert_buffer_factor applies to parallel.expert_dispatch = 'all_gather' only, "
                f"not {self.dispatch!r}"
            )
        return self

    @model_validator(mode="after")
    def _cuda_graphs_need_compile(self) -> ParallelConfig:
        if self.cuda_graphs and not self.compile:
            raise ValueError(
                "parallel.cuda_graphs needs parallel.compile = true (the graphs are the compiled layers'); "
                "set parallel.cuda_graphs=false to run the layers uncompiled"
            )
        return self
