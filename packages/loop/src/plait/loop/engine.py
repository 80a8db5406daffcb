"""This rank's model stages and the executor of plait.pipelining that runs every step on them.

:func:`build_stages` turns a :class:`~plait.loop.providers.ModelProvider` into this rank's stages;
:func:`build_executor` gives the one executor that runs each training step on them (pp=1:
:class:`~plait.pipelining.OfflineExecutor`, pp>1: a :class:`~plait.pipelining.PipelineExecutor` of
the schedule), or a forward-only one on the same stages for evaluation.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager

import torch
from plait.dist_core import DistributedContext
from plait.loop.batch_plan import BatchPlan
from plait.loop.compile_compat import allow_retained_compiled_backward
from plait.loop.config import TrainerConfig
from plait.loop.grads import prepare_fsdp_for_sum
from plait.loop.loss import StepLoss, batch_of
from plait.loop.providers import ModelProvider, OnePassLoss
from plait.loop.topology import Topology
from plait.pipelining import (
    ActionKind,
    BackwardHook,
    BaseScheduleConfig,
    MicrobatchView,
    OfflineExecutor,
    PipelineExecutor,
    Program,
    build_forward_program,
    build_program,
)
from torch import nn

__all__ = ["Executor", "build_executor", "build_stages", "place_stages", "quiet_cpu_mesh_init"]

logger = logging.getLogger("plait.loop")
Executor = OfflineExecutor | PipelineExecutor


def place_stages(schedule: BaseScheduleConfig | None, topology: Topology) -> tuple[int, list[int]]:
    """The model's number of stages and this rank's stage indices under ``schedule`` (None: one stage)."""
    if schedule is None:
        return 1, [0]
    placement = schedule.topology(topology.pp_size)
    return placement.num_stages, sorted(placement.stages_of(topology.pp_rank))


@contextmanager
def quiet_cpu_mesh_init() -> Iterator[None]:
    """Silence torch's warning that DTensor random ops "may not have complete support" on a CPU mesh.

    plait's CPU meshes are deliberate (every distributed feature runs on gloo) and its sharded
    initialisation is tested against single-process references, so the warning says nothing a user
    can act on. Only that message from that torch module is filtered, only inside the block.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore",
            message="DTensor random operators may not have complete support on cpu device mesh",
            category=UserWarning,
            module=r"torch\.distributed\.tensor\._dispatch",
        )
        yield


def build_stages(
    model: ModelProvider,
    config: TrainerConfig,
    ctx: DistributedContext,
    topology: Topology,
    stage_indices: Sequence[int],
    num_stages: int,
    device: torch.device,
) -> list[nn.Module]:
    """This rank's stages of the model, in training mode: each built on meta, parallelized and
    materialised on ``device``, then given the initial weights and prepared for FSDP2 gradient sums.

    Raises:
        NotImplementedError: context parallelism with parameters that FSDP2/DTensor does not manage.
    """
    parts: list[nn.Module] = []
    for s in stage_indices:
        part = model.build_stage(s, num_stages)
        part = model.parallelize(part, ctx, config)
        with quiet_cpu_mesh_init():
            model.materialize(part, device)
        parts.append(part)
    model.load_initial_weights(parts)
    for part in parts:
        part.train()
    prepare_fsdp_for_sum(parts)
    if topology.cp_size > 1 and _has_plain_params(parts):
        raise NotImplementedError("context parallelism needs the model's parameters managed by FSDP2/DTensor")
    return parts


def _has_plain_params(parts: Sequence[nn.Module]) -> bool:
    from torch.distributed.tensor import DTensor

    return any(not isinstance(p, DTensor) for part in parts for p in part.parameters())


def forwards_in_flight(program: Program, stage: int) -> int:
    """The most forwards of ``stage`` whose weight gradients are not yet computed, at any point of
    ``program`` (a forward opens one; a full backward, or a split backward's weight pass, closes it)."""
    peak = 0
    for actions in program.actions:
        n = 0
        for action in actions:
            for a in action.sub_actions():
                if a.stage != stage:
                    continue
                if a.kind is ActionKind.FORWARD:
                    n += 1
                    peak = max(peak, n)
                elif a.kind in (ActionKind.BACKWARD, ActionKind.BACKWARD_WEIGHT):
                    n -= 1
    return peak


def _bound_loss_gradients(stages: Mapping[int, nn.Module], program: Program, last: int) -> None:
    """Two-pass loss on the last stage when its schedule holds several forwards before their backwards.

    A loss computed in one pass (a :class:`~plait.loop.providers.OnePassLoss`, e.g. plait.models'
    ``LMHead``) keeps the classifier's gradient from the forward to the backward: once per forward in
    flight. Such modules are asked to use two passes when more than one forward of the last stage is
    in flight (GPipe, deferred weight passes); an explicit choice is kept.
    """
    if last not in stages or (in_flight := forwards_in_flight(program, last)) <= 1:
        return
    switched = [m for m in stages[last].modules() if isinstance(m, OnePassLoss) and m.use_two_pass_loss()]
    if switched:
        logger.info(
            "%s holds up to %d forwards of the last stage before their weight gradients: two-pass loss",
            program.name,
            in_flight,
        )


def build_executor(
    stages: Mapping[int, nn.Module],
    num_stages: int,
    loss: StepLoss,
    plan: BatchPlan,
    schedule: BaseScheduleConfig | None,
    topology: Topology,
    device: torch.device,
    *,
    forward_only: bool = False,
    on_backward: BackwardHook | None = None,
    fsdp_gather_once: bool = False,
) -> Executor:
    """The executor of ``stages`` (stage index -> module of this rank) with ``loss`` as its loss function.

    Each stage's inputs are the task's (``loss.task.stage_inputs``); losses are summed
    (``loss_reduction="sum"``). Without a ``schedule`` (pp=1) an
    :class:`~plait.pipelining.OfflineExecutor` over ``plan.num_microbatches``; with one a
    :class:`~plait.pipelining.PipelineExecutor` of it over ``topology.pp_group``, or of
    :func:`~plait.pipelining.build_forward_program` of it when ``forward_only`` (evaluation).
    ``fsdp_gather_once``: each FSDP2 module is gathered once per step (``fsdp.gather_once_per_step``).
    """

    def stage_inputs(stage: int, mb: MicrobatchView) -> dict[str, torch.Tensor]:
        return loss.task.stage_inputs(batch_of(mb), stage, num_stages)

    if schedule is None:
        return OfflineExecutor(
            stages, loss, plan.num_microbatches, forward_kwargs_fn=stage_inputs, loss_reduction="sum",
            forward_only=forward_only, on_backward=on_backward, fsdp_gather_once=fsdp_gather_once,
        )  # fmt: skip
    program = build_program(schedule, topology.pp_size)
    if not forward_only:
        _bound_loss_gradients(stages, program, num_stages - 1)
    assert topology.pp_group is not None
    executor = PipelineExecutor(
        build_forward_program(program) if forward_only else program,
        stages, topology.pp_group, loss, forward_kwargs_fn=stage_inputs,
        loss_reduction="sum", device=device, on_backward=on_backward, fsdp_gather_once=fsdp_gather_once,
    )  # fmt: skip
    if executor.splits_backward and allow_retained_compiled_backward():
        # The I pass keeps the autograd graph for the W pass (retain_graph); a torch.compile'd backward
        # with donated buffers refuses that (seen with the compiled FlexAttention on GPU). The compiled
        # parts (FlexAttention, per-layer compile) compile at their first forward, after this.
        logger.info("split-backward schedule: compiled backwards no longer donate their buffers")
    return executor
