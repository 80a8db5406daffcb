"""``plait plan``: every layout a job can run on N GPUs, with its memory per GPU and step time predicted.

:func:`plan` enumerates the candidates (:mod:`~plait.train.planner.layouts`), ranks them all with estimated
model states and pipeline bubbles, then lets the job's own checks refuse the invalid ones among the most
promising (the batch plan, the pipeline schedule's program, the model built and parallelised on meta under
a fake process group of N ranks, one or two layers of each kind standing for the others:
:mod:`~plait.train.planner.memory`), and prices each valid one:

- **memory per GPU** (the largest over the pipeline ranks): the sharded parameters, gradients and optimizer
  moments as built (exact); the FSDP2 units gathered at once (all of a stage's units with
  ``reshard_after_forward = false`` or ``fsdp.gather_once_per_step``, else the two largest and the root's);
  the activations of one microbatch per stage (one sample's,
  :func:`~plait.train.planner.memory.activation_profile`, times the microbatch size; with the ``all_gather``
  expert dispatch measured through that dispatch over a fake group of the layout's EP ranks, whose expert
  buffers hold every EP rank's tokens: :meth:`PlanJob.saved`) times the microbatches the schedule holds in
  flight (the pipeline simulator's peak); what the backward holds above them at its peak (a checkpointed layer
  recomputed, its temporaries: the largest layer's activations times the machine's ``backward_scale``); the
  unsharded gradients and reduce-scatter buffer of the largest unit; the allocator's slack (reserved above
  allocated bytes, in proportion to the largest layer's activations of a microbatch, under FSDP2 at least the
  machine's ``fsdp_slack_bytes``; :class:`~plait.train.planner.timing.Machine`). With one microbatch per step
  the gradients, set to None after each step, are created by the backward as the activations are freed: the
  peak holds those outside the decoder layers, or all of them with the activations gone, whichever is more.
- **step time**: each stage's microbatch takes its GPU work or, when longer, the host's time to issue it (the
  machine's host floor of the checkpointing mode and the job's own per microbatch, the stage's share of the
  layers, plus FSDP2's host time per unit, the mean of the step's last microbatch, which reduces the
  gradients, and those before it, which accumulate them, plus what expert parallelism adds per MoE layer). The
  GPU work is the training FLOPs of its layers (and of the LM head on the last stage) at the machine's FLOP/s,
  divided by the tensor-parallel degree, times the mode's recompute factor, plus FSDP2's GPU time per unit
  (the same mean, for units of the layout's mean gathered bytes) and expert parallelism's per token and MoE
  layer; a forward is a third of it before recomputation. FSDP2's and expert parallelism's figures are
  measured by ``--calibrate`` on the machine's GPUs (the job's model with and without them: their
  collectives, the waits for the other ranks, their own kernels and launches; :func:`~plait.train.planner.timing.fsdp_s`,
  :func:`~plait.train.planner.timing.expert_parallel_s`); without them expert parallelism's exchanges' bytes
  are priced at the bandwidth. Tensor and context parallelism are measured the same way (what they add to a
  layer's host and GPU time; :func:`~plait.train.planner.timing.split_parallel_s`); without the figures their
  collectives per microbatch (and unmeasured expert parallelism's) are added to the stage (they wait in the
  layer); the pipeline simulator composes the stages with the schedule's program and the send/recv time;
  FSDP2's all-gathers and reduce-scatters hide behind the compute except those of the units gathered before
  the first layer and reduced after the last (the embedding's and the root's; in the measured GPU time when
  there is one) and whatever exceeds the compute; HSDP's replica all-reduce, the optimizer step (bytes moved
  at the machine's rate) and the step's fixed cost (data, trainer) follow. ``--calibrate`` measures the rates,
  floors and fixed costs (:func:`calibrated`).

The table ranks the layouts that fit by predicted tokens per second per GPU and says what limits each:
``memory`` (within 10% of the GPU), ``bubble`` (the simulator's idle share above 15%), ``communication``
(exposed collectives above 20% of the step), ``host`` (a stage's microbatch is issued slower than the GPU
runs it: larger microbatches would be as fast per microbatch) or ``compute``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import logging
import tempfile
import warnings
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from plait.loop import BatchPlan, ConfigError, load_config, split_cli_overrides
from plait.models import stage_layer_ids
from plait.moe import MoELayer, expert_parallel
from plait.pipelining import ActionCosts, build_program, lower, simulate
from plait.train.config import JobConfig, StartupError, split_backward_refusal
from plait.train.planner.layouts import CHECKPOINTING, Layout, candidate_layouts
from plait.train.planner.memory import (
    ActivationProfile,
    SavedBytes,
    StateBytes,
    activation_profile,
    context,
    fake_world,
    keep_layers,
    saved_bytes,
    stand_ins,
    state_bytes,
)
from plait.train.planner.timing import (
    Machine,
    activation_bytes,
    expert_parallel_s,
    forward_backward_s,
    fsdp_s,
    load_machine,
    optimizer_step,
    probe_ranks,
    run_job,
    split_parallel_s,
    static_shapes,
)
from torch.distributed.device_mesh import init_device_mesh

__all__ = ["Layout", "Machine", "Plan", "PlanJob", "Prediction", "main", "plan"]

GIB = 2**30


@dataclass(frozen=True)
class Prediction:
    """One valid layout, priced.

    Attributes:
        layout: the layout.
        step_s: predicted seconds per optimizer step.
        tokens_per_s_per_gpu: the global batch's tokens per second, per GPU.
        peak_bytes: predicted peak memory of the fullest GPU.
        limit: what bounds it: ``memory``, ``bubble``, ``communication``, ``host`` or ``compute``.
        memory: the peak's parts (bytes) on the fullest pipeline rank.
        time: the step's parts (seconds).
        num_stages: the model's pipeline stages.
        first_rank_peak_bytes: predicted peak of the first pipeline rank (global rank 0, whose memory
            ``plait train`` logs); ``peak_bytes`` without pipeline stages.
    """

    layout: Layout
    step_s: float
    tokens_per_s_per_gpu: float
    peak_bytes: float
    limit: str
    memory: dict[str, float] = field(default_factory=dict)
    time: dict[str, float] = field(default_factory=dict)
    num_stages: int = 1
    first_rank_peak_bytes: float = 0.0


@dataclass(frozen=True)
class Plan:
    """The priced layouts (fastest first), those over the GPU's memory, why the others were refused (counted
    by the reasons' first 170 characters, which leave out most of what names one layout; ``examples``: the
    first whole reason of each), and how many valid-looking layouts were ranked below those built exactly
    (``unverified``)."""

    gpus: int
    machine: Machine
    fits: list[Prediction]
    too_big: list[Prediction]
    refused: Counter[str]
    unverified: int = 0
    examples: dict[str, str] = field(default_factory=dict)


Placement = tuple[tuple[int, ...], ...]  # the stages of each pipeline rank
RankStates = list[tuple[StateBytes, dict[int, list[int]]]]  # per pipeline rank: states, layers per stage
log = logging.getLogger("plait.plan")  # INFO: the calibration's raw probe times
_REFUSALS = (ValueError, NotImplementedError, RuntimeError, AssertionError)  # the job's checks raise these


class _Refused(ValueError):
    """A refusal already named by its exception's type (``"RuntimeError: ..."``)."""


def state_key(layout: Layout, num_stages: int) -> tuple[int, ...]:
    """What a layout's model states depend on (FSDP shards over data x context ranks alike), and whether it
    has context ranks at all: the plan refuses context parallelism for some jobs (models with sequential
    mixers, CUDA graphs), which a build of the data-parallel layout with the same states would not ask."""
    dp = layout.dp_shard * layout.cp
    return (layout.pp, num_stages, layout.dp_replicate, dp, layout.tp, layout.ep, int(layout.cp > 1))


def _refusal(e: Exception) -> str:
    if isinstance(e, _Refused):
        return str(e)
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"  # a bare assert has no message


def _gist(reason: str) -> str:
    """What refusals are counted by: ``reason``'s first 170 characters."""
    return reason if len(reason) <= 170 else reason[:170] + " ..."


def _once(cache: dict[Any, Any], key: Any, make: Callable[[], Any]) -> Any:
    """``cache[key]``, made by ``make()`` the first time; what the job's checks raised then is raised again
    (a ValueError naming it)."""
    if key not in cache:
        try:
            cache[key] = make()
        except _REFUSALS as e:
            cache[key] = _Refused(_refusal(e))
    value = cache[key]
    if isinstance(value, _Refused):
        raise _Refused(str(value))
    return value


class PlanJob:
    """The job's config and what the planner builds from it, cached across layouts."""

    def __init__(self, config: JobConfig) -> None:
        from plait.train.job import NO_MODEL, build_provider

        if config.model is None:
            raise ConfigError(NO_MODEL)
        self.config = config
        self.model = config.model
        self.build_provider = build_provider
        self.flops_per_token = float(self.provider().flops_per_token(config.batching.seq_len))
        self.stand_in = stand_ins(
            self.model, range(self.model.num_hidden_layers)
        )  # the layer measured for each
        self._inventory: dict[str, Any] | None = None
        self.schedules: dict[tuple[Any, ...], Any] = {}
        self.programs: dict[tuple[Any, ...], Any] = {}
        self.prototypes: dict[tuple[int, int], tuple[torch.nn.Module, dict[int, int]]] = {}
        self.stages: dict[tuple[Any, ...], tuple[StateBytes, list[int]] | _Refused] = {}
        self.ranks: dict[tuple[Any, ...], RankStates] = {}
        self.forwards: dict[tuple[int, str, int], tuple[SavedBytes, SavedBytes]] = {}
        self.activations: dict[tuple[Any, ...], ActivationProfile] = {}
        self.stage_acts: dict[tuple[Any, ...], tuple[int, ...]] = {}
        self.memos: dict[tuple[Any, ...], Any] = {}

    def schedule(
        self, batch_plan: BatchPlan, layout: Layout, *, exact: bool = True
    ) -> tuple[Any, int, Placement]:
        """The layout's lowered pipeline program (None without pipelining, or with ``exact=False``: the
        first pass builds none), stage count and the stages of each pipeline rank.

        Raises:
            ValueError: the schedule refuses the layout (its own checks), or the layers' checkpointing
                cannot run its program (:func:`~plait.train.config.split_backward_refusal`).
        """
        if layout.pp == 1:
            return None, 1, ((0,),)
        key = (layout.schedule, layout.stages_per_rank, layout.pp, batch_plan.num_microbatches)

        def topology() -> tuple[Any, int, Placement]:
            schedule = batch_plan.schedule(layout.pipeline_options())
            topo = schedule.topology(layout.pp)
            return (
                schedule,
                topo.num_stages,
                tuple(tuple(sorted(topo.stages_of(p))) for p in range(layout.pp)),
            )

        schedule, num_stages, placement = _once(self.schedules, key, topology)
        program = (
            _once(self.programs, key, lambda: lower(build_program(schedule, layout.pp))) if exact else None
        )
        if why := split_backward_refusal(program, layout.checkpointing, self.config.parallel.compile):
            raise ValueError(why)
        return program, num_stages, placement

    def memo(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, computed once per job."""
        if (fn, *args) not in self.memos:
            self.memos[fn, *args] = fn(*args)
        return self.memos[fn, *args]

    def provider(self, **parallel: Any) -> Any:
        cfg = self.config.model_copy(update={"parallel": self.config.parallel.model_copy(update=parallel)})
        return self.build_provider(cfg)

    def stage(self, s: int, num_stages: int) -> tuple[torch.nn.Module, dict[int, int]]:
        """Stage ``s`` of ``num_stages`` built on meta with the stand-ins of its decoder layers only
        (:func:`~plait.train.planner.memory.stand_ins`), not parallelised (a fresh copy each time: the plans
        change it in place), and its layers' stand-ins."""
        if (s, num_stages) not in self.prototypes:
            stage = self.provider(compile=False).build_stage(s, num_stages)
            stand_in = stand_ins(self.model, [ly.layer_idx for ly in stage.decoder_layers()])
            self.prototypes[s, num_stages] = keep_layers(stage, set(stand_in.values())), stand_in
        stage, stand_in = self.prototypes[s, num_stages]
        return copy.deepcopy(stage), stand_in

    def rank_states(
        self, layout: Layout, num_stages: int, placement: Placement, *, exact: bool = True
    ) -> RankStates:
        """Per pipeline rank: its state bytes and the decoder layers of each of its stages; each stage's
        from the job's model built and parallelised on meta under a fake group
        (:mod:`~plait.train.planner.memory`), or with ``exact=False`` estimated (:meth:`estimated_stage`).

        Raises:
            ValueError: the job's plan refuses the layout (the message says why).
        """
        key = (exact, state_key(layout, num_stages), placement)
        if key not in self.ranks:
            stage = self.stage_states if exact else self.estimated_stage
            per_rank: RankStates = []
            for p, indices in enumerate(placement):
                parts = {s: stage(layout, num_stages, s, p) for s in indices}
                states = sum((st for st, _ in parts.values()), StateBytes(0, 0, 0, ()))
                per_rank.append((states, {s: layers for s, (_, layers) in parts.items()}))
            self.ranks[key] = per_rank
        return self.ranks[key]

    def stage_states(self, layout: Layout, num_stages: int, s: int, p: int) -> tuple[StateBytes, list[int]]:
        """Stage ``s``'s state bytes on pipeline rank ``p`` and its decoder layers: the stage built with the
        stand-ins of its layers and parallelised as that rank does, under a fake group of the layout's world
        (a stage's states do not depend on which rank holds it)."""

        def build() -> tuple[StateBytes, list[int]]:
            stage, stand_in = self.stage(s, num_stages)
            rank = p * (layout.world // layout.pp)
            with fake_world(layout.world, rank):
                stage = self.provider(compile=False).parallelize(stage, context(layout.mesh(), rank))
                per_unit = self.config.parallel.fsdp_layers_per_unit
                return state_bytes(stage, self.config.optimizer, stand_in, per_unit), list(stand_in)

        return _once(self.stages, (state_key(layout, num_stages), s), build)

    def estimated_stage(
        self, layout: Layout, num_stages: int, s: int, p: int
    ) -> tuple[StateBytes, list[int]]:
        """:meth:`stage_states` estimated from the unsharded model's parameters (dense ones split over tensor
        and FSDP ranks, experts over expert and their FSDP ranks): the first pass's ranking only."""
        del p
        inv = self.inventory()
        layers = stage_layer_ids(self.model.num_hidden_layers, s, num_stages)
        fsdp = layout.dp_shard * layout.cp
        expert_fsdp = max(1, layout.dp * layout.cp // layout.ep) if layout.ep > 1 else fsdp
        ends = inv["embed"] * (s == 0) + inv["head"] * (s == num_stages - 1)
        dense = sum(inv["dense"][i] for i in layers) + ends
        experts = sum(inv["experts"][i] for i in layers)
        local = dense / layout.tp / fsdp + experts / layout.ep / expert_fsdp
        units = [inv["dense"][i] / layout.tp + inv["experts"][i] / layout.ep for i in layers]
        units.append(ends / layout.tp)
        states = StateBytes(
            int(local), int(local * inv["trainable"]), int(local * inv["optimizer_ratio"]),
            tuple(int(u) for u in units), int(ends / layout.tp / fsdp * inv["trainable"]),
        )  # fmt: skip
        return states, layers

    def inventory(self) -> dict[str, Any]:
        """Parameter bytes of the unsharded model: per layer (dense, experts), the embedding, the rest (head,
        final norm); the trainable share and the optimizer's bytes per parameter byte."""
        if self._inventory is None:
            model, stand_in = self.stage(0, 1)
            built: dict[int, list[int]] = defaultdict(
                lambda: [0, 0, 0]
            )  # per built layer: dense, experts, trainable
            embed = head = trainable = 0
            for name, q in model.named_parameters():
                nbytes = q.numel() * q.element_size()
                if ".layers." in name:
                    layer = built[int(name.split(".layers.")[1].split(".")[0])]
                    layer[".experts." in name] += nbytes
                    layer[2] += nbytes * q.requires_grad
                    continue
                trainable += nbytes * q.requires_grad
                if "embed" in name:
                    embed += nbytes
                else:
                    head += nbytes
            dense, experts = (
                [built[j][0] for j in stand_in.values()],
                [built[j][1] for j in stand_in.values()],
            )
            total = embed + head + sum(dense) + sum(experts)
            trainable += sum(built[j][2] for j in stand_in.values())
            states = state_bytes(model, self.config.optimizer, stand_in)
            self._inventory = {
                "dense": dense, "experts": experts, "embed": embed, "head": head,
                "trainable": trainable / max(total, 1), "optimizer_ratio": states.optimizer / max(total, 1),
            }  # fmt: skip
        return self._inventory

    def saved(self, seq: int, mode: str, ep: int = 1) -> tuple[SavedBytes, SavedBytes]:
        """:func:`~plait.train.planner.memory.saved_bytes` of one sample of ``seq`` tokens through the job's
        unsharded model built with the layers' stand-ins, checkpointed by ``mode`` (``none``: with the
        outputs of the selective policy's ops; ``full``); with ``ep > 1`` its MoE layers dispatch by
        all-gather over ``ep`` ranks of a fake group (:meth:`expert_buffer_ranks`)."""
        if (seq, mode, ep) not in self.forwards:
            ac = self.config.parallel.activation_checkpointing
            provider = self.provider(
                compile=False, activation_checkpointing=ac.model_copy(update={"mode": mode, "every": 1})
            )
            stage, _ = self.stage(0, 1)
            sac_ops = frozenset(ac.save_ops) if mode == "none" else None
            with fake_world(ep, 0) if ep > 1 else contextlib.nullcontext():
                stage = provider.parallelize(stage, None)
                if ep > 1:
                    mesh = init_device_mesh("cpu", (ep,), mesh_dim_names=("ep_shard",))
                    factor = self.config.parallel.expert_buffer_factor
                    for layer in stage.decoder_layers():
                        if isinstance(layer.mlp, MoELayer):
                            expert_parallel(layer.mlp, mesh, backend="all_gather", buffer_factor=factor)
                self.forwards[seq, mode, ep] = saved_bytes(stage, seq, self.model.hidden_size, sac_ops)
        return self.forwards[seq, mode, ep]

    def expert_buffer_ranks(self, layout: Layout) -> int:
        """The expert-parallel degree whose dispatch sizes the layers' activations: ``layout.ep`` for the
        ``all_gather`` dispatch, whose expert buffers hold every EP rank's tokens (``P * T * k`` rows, or
        ``parallel.expert_buffer_factor`` times the balanced share: up to ``P`` times one GPU's expert
        activations), else 1 (the all-to-all's buffers follow the routing: balanced, one GPU's)."""
        return layout.ep if self.config.parallel.dispatch == "all_gather" else 1

    def activation(self, layout: Layout, *, exact: bool = True) -> ActivationProfile:
        """One sample's activations on a rank of ``layout`` (the first pass scales the whole sequence's by the
        context-parallel degree instead of measuring each shard length)."""
        measured = layout.cp if exact else 1  # the context-parallel degree whose shard is measured
        ep = self.expert_buffer_ranks(layout)
        key = (layout.cp, measured, layout.checkpointing, ep)
        if key not in self.activations:
            seq = self.config.batching.seq_len // measured
            profile = activation_profile(
                lambda mode: self.saved(seq, mode, ep), layout.checkpointing, list(self.stand_in.values())
            )
            self.activations[key] = profile if measured == layout.cp else profile.scaled(1 / layout.cp)
        return self.activations[key]

    def stage_activations(self, layout: Layout, num_stages: int, *, exact: bool = True) -> tuple[int, ...]:
        """One sample's activations on each of ``num_stages`` stages of ``layout`` (:meth:`activation`)."""
        key = (
            layout.cp,
            exact,
            layout.checkpointing,
            layout.tp,
            num_stages,
            self.expert_buffer_ranks(layout),
        )
        if key not in self.stage_acts:
            acts, n = self.activation(layout, exact=exact), self.model.num_hidden_layers
            self.stage_acts[key] = tuple(
                acts.stage(stage_layer_ids(n, s, num_stages), s == 0, s == num_stages - 1, layout.tp)
                for s in range(num_stages)
            )
        return self.stage_acts[key]


def _comm_per_layer(job: PlanJob, layout: Layout, machine: Machine) -> float:
    """Tensor and context parallelism's collectives of one microbatch in one layer (forward and backward):
    they wait inside the layers (each only when the machine has not measured it)."""
    m, b = job.model, job.config.batching
    act = layout.microbatch_size * b.seq_len // layout.cp * m.hidden_size * 2  # bf16 activations
    s = 0.0
    if layout.tp > 1 and machine.split_s("tensor", layout.tp) is None:
        s += 4 * machine.collective_s("all_reduce", act, layout.tp)  # two all-reduces forward, two backward
    if layout.cp > 1 and machine.split_s("context", layout.cp) is None:
        # keys and values gathered in the forward, their gradients reduce-scattered back
        kv = 2 * layout.microbatch_size * b.seq_len * m.kv_heads * m.resolved_head_dim * 2 // layout.tp
        s += 2 * machine.collective_s("all_gather", kv, layout.cp)
    return s


def _measured(
    figures: tuple[float, float], layout: Layout, machine: Machine, tokens: int
) -> tuple[float, float]:
    """A parallelism's measured ``(host seconds per layer and microbatch, GPU seconds per token and layer)`` as
    ``(host seconds, GPU seconds)`` of one layer's microbatch of ``tokens`` under the layout's checkpointing:
    the host's by the mode's host floor over none's, the GPU's by its recompute factor (a checkpointed layer
    runs its forward again)."""
    host, per_token = figures
    mode, floor = layout.checkpointing, machine.of_mode("host_s", "none")
    return (host * (machine.of_mode("host_s", mode) / floor if floor else 1.0),
            per_token * tokens * machine.of_mode("recompute", mode))  # fmt: skip


def _split_parallel(job: PlanJob, layout: Layout, machine: Machine) -> dict[str, tuple[float, float]]:
    """``{"tp": (host seconds, GPU seconds), "cp": ...}`` that tensor and context parallelism add to one
    layer's microbatch, as the machine measured them for the layout's degrees (else 0: :func:`_comm_per_layer`
    prices their collectives)."""
    tokens = layout.microbatch_size * job.config.batching.seq_len // layout.cp  # a rank's
    split = {}
    for name, kind, degree in (("tp", "tensor", layout.tp), ("cp", "context", layout.cp)):
        measured = machine.split_s(kind, degree) if degree > 1 else None
        split[name] = (0.0, 0.0) if measured is None else _measured(measured, layout, machine, tokens)
    return split


def _expert_parallel(job: PlanJob, layout: Layout, machine: Machine) -> tuple[float, float, float]:
    """``(host seconds, GPU seconds, waiting seconds)`` that expert parallelism adds to one MoE layer's
    microbatch: as the machine measured it for the layout's dispatch and degree (:func:`_measured`), else its
    exchanges' bytes at the bandwidth, waited on inside the layer."""
    if layout.ep == 1:
        return 0.0, 0.0, 0.0
    m = job.model
    dispatch = job.config.parallel.dispatch
    tokens = layout.microbatch_size * job.config.batching.seq_len // layout.cp
    if (measured := machine.expert_s(dispatch, layout.ep)) is not None:
        return (*_measured(measured, layout, machine, tokens), 0.0)
    act = tokens * m.hidden_size * 2  # bf16 activations
    if dispatch == "all_gather":
        wait = 2 * (machine.collective_s("all_gather", act * layout.ep, layout.ep)
                    + machine.collective_s("reduce_scatter", act * layout.ep, layout.ep))  # fmt: skip
    else:
        wait = 4 * machine.collective_s("all_to_all", act * getattr(m, "num_experts_per_tok", 1), layout.ep)
    return 0.0, 0.0, wait


def _fsdp_collectives(
    units: tuple[int, ...], leading: int, fsdp: int, machine: Machine
) -> tuple[float, float, float, float]:
    """Seconds of FSDP2's collectives of ``units`` over ``fsdp`` ranks: all the all-gathers, all the
    reduce-scatters, and those of the ``leading`` bytes (gathered before the first layer, reduced after the
    last: no compute hides them)."""
    gather = [machine.collective_s("all_gather", u, fsdp) for u in units]
    scatter = [machine.collective_s("reduce_scatter", u, fsdp) for u in units]
    lead_gather = machine.collective_s("all_gather", leading, fsdp)
    return sum(gather), sum(scatter), lead_gather, machine.collective_s("reduce_scatter", leading, fsdp)


def _resident(states: StateBytes, fsdp: bool, reshard: bool) -> tuple[float, dict[str, float]]:
    """The bytes a rank's model states keep on its GPU and their parts: the local states; with FSDP the units
    gathered at once (all without resharding, else the two largest and the root's) and the reduce-scatter
    buffers of the largest."""
    gathered = sorted(states.gathered)
    inflight = sum(gathered) if not reshard else sum(gathered[-2:]) + (states.gathered[-1] if gathered else 0)
    biggest = gathered[-1] if gathered else 0
    parts = {
        "params": float(states.params), "grads": float(states.grads), "optimizer": float(states.optimizer),
        "gathered": float(inflight if fsdp else 0), "reduce_buffers": float(2 * biggest if fsdp else 0),
    }  # fmt: skip
    return sum(parts.values()), parts


def _rank_memory(
    job: PlanJob,
    states: StateBytes,
    activations: float,
    fsdp: bool,
    reshard: bool,
    nmb: int,
    backward: float,
    slack: float,
) -> dict[str, float]:
    """A pipeline rank's peak, by part: its states, its peak of activations in flight, one layer's backward."""
    resident = job.memo(_resident, states, fsdp, reshard)[1]
    grads = resident["grads"]
    if nmb == 1:  # set to None after each step: a lone microbatch's backward creates them as activations go
        grads = max(float(states.outer_grads), grads - float(activations) - backward)
    return {
        "params": resident["params"], "grads": grads, "optimizer": resident["optimizer"],
        "gathered": resident["gathered"], "activations": float(activations), "backward": backward,
        "reduce_buffers": resident["reduce_buffers"], "allocator_slack": slack,
    }  # fmt: skip


def predict(job: PlanJob, layout: Layout, machine: Machine, *, exact: bool = True) -> Prediction | str:
    """The prediction of ``layout``, or why the job refuses it; ``exact=False`` estimates the model states
    and the pipeline's bubble instead of building the stages and the schedule's program (the first pass
    of :func:`plan`: the batch plan and the schedule's options are checked, not the rest)."""
    cfg, m = job.config, job.model
    try:
        batch_plan = BatchPlan(cfg.batching.global_batch_size, layout.microbatch_size, layout.dp,
                               cfg.batching.seq_len, layout.cp)  # fmt: skip
        nmb = batch_plan.num_microbatches
        program, num_stages, placement = job.schedule(batch_plan, layout, exact=exact)
        if num_stages > m.num_hidden_layers:
            return f"{num_stages} stages for {m.num_hidden_layers} layers"
        ranks = job.rank_states(layout, num_stages, placement, exact=exact)
        acts = job.activation(layout, exact=exact)
        stage_acts = job.stage_activations(layout, num_stages, exact=exact)
    except _REFUSALS as e:
        return _refusal(e)

    seq = cfg.batching.seq_len
    tokens_mb = layout.microbatch_size * seq // layout.cp
    flops_token = job.flops_per_token
    head_flops = 6 * m.hidden_size * m.vocab_size
    layer_flops = (flops_token - head_flops) / m.num_hidden_layers
    recompute = machine.of_mode("recompute", layout.checkpointing)
    host_s = machine.of_mode("host_s", layout.checkpointing)
    idle_s = machine.of_mode("idle_s", layout.checkpointing)
    comm_layer = _comm_per_layer(job, layout, machine)
    ep_host, ep_gpu, comm_moe = _expert_parallel(job, layout, machine)
    split = _split_parallel(job, layout, machine)
    split_host, split_gpu = (sum(f[i] for f in split.values()) for i in (0, 1))
    fsdp_n = layout.dp_shard * layout.cp
    states0 = ranks[0][0]
    # FSDP2's own time per microbatch on a stage (host and GPU), its units' share of the rank's: the mean of
    # the step's last microbatch, which reduces the gradients, and those before it, which accumulate them
    units = states0.units / len(ranks[0][1]) if fsdp_n > 1 else 0.0
    fsdp_host = (machine.fsdp_unit_s + (nmb - 1) * machine.fsdp_accumulate_s) / nmb * units
    fsdp_gpu = (machine.fsdp_unit_gpu_s + (nmb - 1) * machine.fsdp_accumulate_gpu_s) / nmb * units
    if machine.fsdp_unit_bytes and states0.units:  # the GPU's part for units of this layout's size
        fsdp_gpu *= sum(states0.gathered) / states0.units / machine.fsdp_unit_bytes
    host_bound = False

    def stage_costs(layers: int, moe_layers: int, last: bool) -> tuple[float, float]:
        """A microbatch's forward and backward through the stage: the GPU's work, or the host's floor when
        longer, plus what waits inside the layers (collectives, expert parallelism)."""
        nonlocal host_bound
        gpu = (layer_flops * layers + head_flops * last) * tokens_mb / layout.tp / machine.flops * recompute
        share = layers / m.num_hidden_layers
        gpu += idle_s * share + fsdp_gpu + ep_gpu * moe_layers + split_gpu * layers
        host = (host_s + machine.microbatch_s) * share + fsdp_host + ep_host * moe_layers
        host += split_host * layers
        host_bound |= host > gpu
        t = max(gpu, host) if machine.host_overlaps else gpu + host
        fwd = t / (3 * recompute)
        comm = comm_layer * layers + comm_moe * moe_layers
        return fwd + comm / 2, t - fwd + comm / 2

    mb = layout.microbatch_size
    scale = machine.of_mode("activation_scale", layout.checkpointing)
    cost_of: dict[tuple[int, int, bool], tuple[float, float]] = {}  # by (layers, MoE layers, last)
    costs, act_bytes = {}, {}
    for _, by_stage in ranks:
        for s, ly in by_stage.items():
            shape = (len(ly), sum(map(m.is_moe_layer, ly)), s == num_stages - 1)
            if shape not in cost_of:
                cost_of[shape] = stage_costs(*shape)
            costs[s] = cost_of[shape]
            act_bytes[s] = float(mb * stage_acts[s]) * scale  # per sample
    moe_total = sum(map(m.is_moe_layer, range(m.num_hidden_layers)))
    tp_comm = (comm_layer * m.num_hidden_layers + comm_moe * moe_total) * nmb / layout.pp
    p2p = machine.collective_s("send_recv", tokens_mb * m.hidden_size * 2, 2) if layout.pp > 1 else 0.0
    if layout.pp == 1:
        f, b = costs[0]
        compute_s, bubble, peak_acts = nmb * (f + b), 0.0, [act_bytes[0]]
    elif program is None:  # the first pass: the bubble of a 1F1B-like schedule, its activations in flight
        slowest = max(f + b for f, b in cost_of.values()) * num_stages / layout.pp
        compute_s = (nmb + (layout.pp - 1) / layout.stages_per_rank) * slowest
        bubble = 1 - nmb * slowest / compute_s
        inflight = nmb if layout.schedule == "gpipe" else min(nmb, layout.pp)
        peak_acts = [inflight * sum(act_bytes[s] for s in by_stage) / len(by_stage) for _, by_stage in ranks]
    else:
        # A split backward's input pass is the whole backward of compiled layers (one graph computes both:
        # plait.pipelining.split_backward) and frees their activations; their weight pass adds gradients up.
        whole = cfg.parallel.compile
        result = simulate(program, ActionCosts(comm=p2p), stage_costs={
            s: ActionCosts(forward=f, backward=b, backward_input=b if whole else b / 2,
                           backward_weight=0.0 if whole else b / 2, comm=p2p, activation_memory=act_bytes[s],
                           input_pass_frees=whole)
            for s, (f, b) in costs.items()
        })  # fmt: skip
        compute_s, bubble, peak_acts = result.step_time, result.bubble_fraction, list(result.peak_activations)

    # FSDP2: every microbatch's forward gathers, and its backward too when resharded after the forward, unless
    # the parameters stay gathered over the step (fsdp.gather_once_per_step; always under CUDA graphs), which
    # keeps every unit's gathered memory; one reduce-scatter per step
    kept = cfg.fsdp.gather_once_per_step or cfg.parallel.cuda_graphs
    reshard = cfg.parallel.reshard_after_forward is not False and not kept
    gathers = (1 if kept else (2 if reshard else 1) * nmb) if fsdp_n > 1 else 0
    fsdp_exposed = 0.0
    if fsdp_n > 1 and ranks[0][0].gathered:
        st = ranks[0][0]
        gather, scatter, first, last = job.memo(_fsdp_collectives, st.gathered, st.leading, fsdp_n, machine)
        # a measured GPU figure holds the first gather and the last reduce-scatter (the probe's microbatch)
        ends = 0.0 if machine.fsdp_unit_gpu_s else first + last
        fsdp_exposed = ends + max(0.0, gathers * gather + scatter - compute_s)
    replica = machine.collective_s(
        "all_reduce", states0.grads, layout.dp_replicate, inter_node=layout.world > machine.gpus_per_node
    )
    optimizer_s = (2 * states0.params + states0.grads + 2 * states0.optimizer) / machine.optimizer_bytes_per_s
    step = compute_s + fsdp_exposed + replica + optimizer_s + machine.step_s
    tok_s = cfg.batching.global_batch_size * seq / step / layout.world

    # memory of the fullest pipeline rank
    totals = [
        job.memo(_resident, st, fsdp_n > 1, reshard)[0] + peak_acts[p] for p, (st, _) in enumerate(ranks)
    ]
    fullest = max(range(len(ranks)), key=totals.__getitem__)
    layer_acts = float(mb * acts.split(acts.transient, layout.tp))  # the largest layer's, unchecked
    backward = layer_acts * machine.of_mode("backward_scale", layout.checkpointing)

    slack = max(layer_acts * machine.allocator_slack, machine.fsdp_slack_bytes if fsdp_n > 1 else 0.0)
    best = _rank_memory(job, ranks[fullest][0], peak_acts[fullest], fsdp_n > 1, reshard, nmb, backward, slack)
    peak = sum(best.values())
    first = (
        best
        if fullest == 0
        else _rank_memory(job, ranks[0][0], peak_acts[0], fsdp_n > 1, reshard, nmb, backward, slack)
    )
    exposed = tp_comm + fsdp_exposed + replica
    if peak > 0.9 * machine.memory_gib * GIB:
        limit = "memory"
    elif bubble > 0.15:
        limit = "bubble"
    elif exposed > 0.2 * step:
        limit = "communication"
    elif host_bound:
        limit = "host"
    else:
        limit = "compute"
    times = {"compute_and_pipeline": compute_s, "bubble_fraction": bubble, "tp_cp_ep_comm": tp_comm,
             "fsdp_exposed": fsdp_exposed, "fsdp_host_per_microbatch": fsdp_host,
             "fsdp_gpu_per_microbatch": fsdp_gpu,
             "ep_host_per_microbatch": ep_host * moe_total, "ep_gpu_per_microbatch": ep_gpu * moe_total,
             **{f"{name}_{part}_per_microbatch": f[i] * m.num_hidden_layers
                for name, f in split.items() for i, part in enumerate(("host", "gpu"))},
             "replica_all_reduce": replica,
             "optimizer": optimizer_s, "step_fixed": machine.step_s}  # fmt: skip
    return Prediction(layout, step, tok_s, peak, limit, best, times, num_stages, sum(first.values()))


def plan(
    config: JobConfig,
    gpus: int,
    machine: Machine | None = None,
    *,
    checkpointing: tuple[str, ...] = CHECKPOINTING,
    exact_limit: int = 12,
    job: PlanJob | None = None,
) -> Plan:
    """Every layout of ``config`` on ``gpus`` GPUs, priced on ``machine`` (default :class:`Machine`).

    ``Plan.fits`` is ranked fastest first, equal speeds by the larger microbatch (:func:`_rank`). Two passes:
    every candidate is priced with estimated model states and pipeline bubbles, then the
    layouts of the most promising distinct meshes (fitting ones first, fastest first) are built (the
    schedule's program, the stages under the fake group) and priced exactly, until ``exact_limit`` meshes
    of which the job accepts a layout are (or all are). Only exactly priced layouts are listed; the
    others are counted in ``Plan.unverified``.
    """
    machine = machine or Machine()
    job = job or PlanJob(config)
    experts = getattr(config.model, "num_experts", None)
    refused = Counter[str]()
    examples: dict[str, str] = {}

    def refuse(reason: str) -> None:
        gist = _gist(reason)
        refused[gist] += 1
        examples.setdefault(gist, reason)

    coarse: dict[tuple[int, ...], list[tuple[Layout, Prediction]]] = {}
    for layout in candidate_layouts(
        gpus, global_batch_size=config.batching.global_batch_size, num_experts=experts,
        gpus_per_node=machine.gpus_per_node, checkpointing=checkpointing,
    ):  # fmt: skip
        result = predict(job, layout, machine, exact=False)
        if isinstance(result, str):
            refuse(result)
            continue
        coarse.setdefault(state_key(layout, result.num_stages), []).append((layout, result))

    def promise(key: tuple[int, ...]) -> tuple[bool, float]:
        best = max(coarse[key], key=lambda lp: lp[1].tokens_per_s_per_gpu)[1]
        return (best.peak_bytes > machine.memory_gib * GIB, -best.tokens_per_s_per_gpu)

    keys = sorted(coarse, key=promise)
    fits: list[Prediction] = []
    too_big: list[Prediction] = []
    accepted = 0  # meshes priced exactly of which the job accepts a layout
    while keys and accepted < exact_limit:
        valid = False
        for layout, _ in coarse[keys.pop(0)]:
            result = predict(job, layout, machine)
            if isinstance(result, str):
                refuse(result)
                continue
            (too_big if result.peak_bytes > machine.memory_gib * GIB else fits).append(result)
            valid = True
        accepted += valid
    fits.sort(key=_rank)
    too_big.sort(key=lambda r: r.peak_bytes)
    unverified = sum(len(coarse[k]) for k in keys)
    return Plan(gpus, machine, fits, too_big, refused, unverified, examples)


def _rank(p: Prediction) -> tuple[float, int]:
    """Fastest first; equal speeds (to 4 significant digits) go to the larger microbatch: fewer microbatches
    run the same work with fewer launches, hooks and pauses between them, which the model does not price
    (each microbatch takes its GPU work or the host's floor, whichever is longer, nothing in between)."""
    return -float(f"{p.tokens_per_s_per_gpu:.4g}"), -p.layout.microbatch_size


def _table(predictions: list[Prediction], top: int) -> str:
    lines = ["| # | layout | tok/s per GPU | step s | peak GiB | limit |", "|---:|---|---:|---:|---:|---|"]
    for i, p in enumerate(predictions[:top], 1):
        lines.append(f"| {i} | {p.layout.name} | {p.tokens_per_s_per_gpu:,.0f} | {p.step_s:.3f} | "
                     f"{p.peak_bytes / GIB:.2f} | {p.limit} |")  # fmt: skip
    return "\n".join(lines)


def explain(p: Prediction) -> str:
    """The breakdown of one prediction."""
    out = [f"layout {p.layout.name}: {p.tokens_per_s_per_gpu:,.0f} tok/s per GPU, step {p.step_s:.4f} s, "
           f"peak {p.peak_bytes / GIB:.3f} GiB ({p.limit})", "memory of the fullest GPU (GiB):"]  # fmt: skip
    out += [f"  {k:<15} {v / GIB:10.4f}" for k, v in p.memory.items()]
    out.append("step (s):")
    out += [f"  {k:<21} {v:10.5f}" for k, v in p.time.items()]
    out.append("run it with: " + " ".join(p.layout.overrides()))
    return "\n".join(out)


def _smallest_fit(config: JobConfig, gpus: int, machine: Machine, job: PlanJob) -> str:
    """What would fit when nothing does on ``gpus`` GPUs: the memory, and the GPU count (doubling)."""
    for n in (gpus * 2**k for k in range(1, 9)):
        result = plan(config, n, machine, job=job)
        if result.fits:
            best = min(result.fits, key=lambda r: r.peak_bytes)
            return f"the smallest count that fits is {n} GPUs ({best.layout.name}, {best.peak_bytes / GIB:.3g} GiB)"
    return f"nothing fits on up to {gpus * 2**8} GPUs of {machine.memory_gib:g} GiB"


def _arguments(argv: list[str]) -> tuple[argparse.Namespace, PlanJob, Machine, tuple[str, ...]]:
    """``plait plan``'s arguments, the job, the machine and the checkpointing modes, each checked (a bad one
    exits naming the flag or the key)."""
    from plait.train.job import adopt_checkpoint_config
    from plait.train.train import DEFAULT_CONFIG

    ap = argparse.ArgumentParser(prog="plait plan", description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument(
        "--config", type=Path, default=DEFAULT_CONFIG, help="the job's config (default: embedded)"
    )
    ap.add_argument("--init-from", type=Path, metavar="HF_DIR", help="the model of a Hugging Face checkpoint "
                    "directory, as plait train --init-from takes it (its config.json; no weights needed)")  # fmt: skip
    ap.add_argument("--gpus", type=int, required=True, help="GPUs to plan for")
    ap.add_argument("--gpus-per-node", type=int, help="GPUs per node (default: min(gpus, 8))")
    ap.add_argument("--gpu-memory", type=float, help="GiB per GPU (default: the machine's, 139.8)")
    ap.add_argument("--machine", type=Path, help="JSON of timing.Machine fields (rates, bandwidths)")
    ap.add_argument(
        "--calibrate",
        action="store_true",
        help="measure the job on this machine's device first (its model, optimizer, FSDP2, a few steps)",
    )
    ap.add_argument("--save-machine", type=Path, help="write the machine's figures (with --calibrate: as measured) "
                    "to this JSON, for --machine")  # fmt: skip
    ap.add_argument("--checkpointing", default=",".join(CHECKPOINTING), help="modes to consider")
    ap.add_argument("--top", type=int, default=15, help="rows of the table")
    ap.add_argument("--explain", metavar="LAYOUT", help="the breakdown of one layout (its name in the table)")
    overrides, rest = split_cli_overrides(argv, JobConfig)
    args = ap.parse_args(rest)
    for flag, value in (("--gpus", args.gpus), ("--gpus-per-node", args.gpus_per_node), ("--top", args.top)):
        if value is not None and value < 1:
            raise SystemExit(f"plait plan: error: {flag} must be >= 1, got {value}")
    if args.gpu_memory is not None and not args.gpu_memory > 0:
        raise SystemExit(f"plait plan: error: --gpu-memory must be > 0 GiB, got {args.gpu_memory}")
    try:
        config = load_config(args.config, overrides, cls=JobConfig)
        if args.init_from is not None:
            config = adopt_checkpoint_config(config, args.init_from, weights=False)
        job = PlanJob(config)
        machine = load_machine(args.machine, args.gpu_memory)
        modes = tuple(args.checkpointing.split(","))
        if bad := [x for x in modes if x not in CHECKPOINTING]:
            raise ValueError(
                f"--checkpointing: unknown mode(s) {bad} (choose from {', '.join(CHECKPOINTING)})"
            )
    except (ConfigError, StartupError, ValueError) as e:
        raise SystemExit(f"plait plan: error: {e}") from None
    machine = dataclasses.replace(machine, gpus_per_node=args.gpus_per_node or min(args.gpus, 8))
    return args, job, machine, modes


def main(argv: list[str] | None = None) -> None:
    """``plait plan --config F [--init-from HF_DIR] --gpus N [--gpus-per-node M] [--gpu-memory GiB] [--calibrate]
    [--machine J] [--save-machine J] [--explain LAYOUT] [--top K] [--section.key=value ...]``."""
    import sys

    args, job, machine, modes = _arguments(sys.argv[1:] if argv is None else argv)
    config = job.config
    if args.calibrate:
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
        try:
            machine = calibrated(job, machine, modes=modes, gpus=args.gpus)
        except RuntimeError as e:  # the job's run failed, or the model does not fit (OutOfMemoryError)
            raise SystemExit(
                f"plait plan: error: --calibrate runs the job's model on one device ({device}) and that failed: "
                f"{e} (without --calibrate, or with --machine J.json of figures measured elsewhere, it plans "
                "from the config alone)"
            ) from None
        print(f"plait plan: calibrated on {device}: {machine.measured()}")
    if args.save_machine is not None:
        try:
            args.save_machine.write_text(machine.to_json() + "\n")
        except OSError as e:
            raise SystemExit(f"plait plan: error: --save-machine {args.save_machine}: {e}") from None
    result = plan(config, args.gpus, machine, checkpointing=modes, job=job)
    print(f"plait plan: {job.model.model_type} on {args.gpus} GPU(s) of {machine.memory_gib:g} GiB, "
          f"{machine.flops / 1e12:.1f} TFLOP/s{' (calibrated)' if args.calibrate else ''}: "
          f"{len(result.fits)} layouts fit, {len(result.too_big)} need more memory, "
          f"{sum(result.refused.values())} refused by the job's checks"
          + (f", {result.unverified} ranked below the {len(result.fits) + len(result.too_big)} priced exactly"
             if result.unverified else ""))  # fmt: skip
    if args.explain:
        match = [p for p in result.fits + result.too_big if p.layout.name == args.explain]
        if not match:
            raise SystemExit(f"plait plan: no valid layout named {args.explain!r} (see the table's names)")
        print(explain(match[0]))
        return
    if result.fits:
        print(_table(result.fits, args.top))
        print("best: " + " ".join(result.fits[0].layout.overrides()))
        if result.refused:  # e.g. a setting of the job that rules out whole families of layouts
            why, n = result.refused.most_common(1)[0]
            print(f"refused most often ({n}x): {result.examples[why]}")
        return
    if result.too_big:
        need = result.too_big[0]
        print(f"nothing fits in {machine.memory_gib:g} GiB: the smallest layout needs {need.peak_bytes / GIB:.3g} GiB "
              f"({need.layout.name}); " + _smallest_fit(config, args.gpus, machine, job))  # fmt: skip
    else:
        print("no layout is valid: "
              + "; ".join(f"{result.examples[k]} ({n}x)" for k, n in result.refused.most_common(5)))  # fmt: skip
    raise SystemExit(1)


@static_shapes()  # each model compiled as the job compiles it
def calibrated(
    job: PlanJob, machine: Machine, *, modes: tuple[str, ...] = CHECKPOINTING, steps: int = 6, gpus: int = 1
) -> Machine:
    """``machine`` with the job measured on this device (a GPU if there is one), one microbatch at a time.

    - Per checkpointing mode of ``modes`` (and ``none``), the job's model (one stage): ``host_s``, a forward
      and backward of one sample (the host's floor: so short a microbatch leaves the GPU waiting); the GPU's
      busy time of one at the microbatch size, which gives ``flops`` (without checkpointing) and
      ``recompute`` (each mode's over it); on a GPU, ``idle_s``: that microbatch's wall time less its busy
      time when the GPU bounds it; ``activation_scale``: the bytes its forward keeps over
      the planner's count, and ``backward_scale``: the backward's peak above them over the count of the
      largest layer's unchecked activations. Under ``parallel.cuda_graphs`` the times are the graphs' and
      the bytes the same compiled layers' launched kernel by kernel (a graph replays its tensors at addresses
      its pool holds, outside the allocator's count; the pool holds as much: the main job reserved 14.2 GiB
      without graphs, 14.3 with, ``results/cuda_graphs.md``).
    - ``optimizer_bytes_per_s``: the job's optimizer stepped on that model's gradients.
    - FSDP2's figures (planning for more than one GPU): the model under FSDP2 (``parallel``'s units, resharding
      and mixed precision) over as many of this machine's GPUs as planned for (one gloo rank without CUDA)
      against the same model without it, at one sample (on a GPU also at the microbatch: the host's floor is
      the lowest wall time) and at two microbatches in one, reducing its gradients and accumulating them: the
      host's and the GPU's extra time per unit of each (``fsdp_unit_s``, ``fsdp_unit_gpu_s``,
      ``fsdp_accumulate_s``, ``fsdp_accumulate_gpu_s``) for units of the mean gathered bytes
      ``fsdp_unit_bytes``, and on a GPU the allocator's slack under FSDP2 (``fsdp_slack_bytes``; :func:`fsdp_s`).
    - ``step_s``: ``plait train`` run for ``steps`` steps of one microbatch each (:func:`run_job`): its step
      less the model's forward and backward (wall time) and the optimizer step; ``microbatch_s``: the job run
      again with four microbatches of one sample per step (the host bounds them), each less the model's
      forward and backward of one sample.
    - ``allocator_slack`` (on a GPU): the peak reserved less the peak allocated bytes of those steps (run
      again without CUDA graphs if the job has them), over the largest layer's activations of their
      microbatch.
    - ``expert_host_s`` and ``expert_token_s`` (a MoE model, for each expert-parallel degree P of ``gpus``
      that divides the experts and that this machine has the GPUs for): the model with its experts sharded
      over P GPUs against the same model whole on each, the wall times of one sample and of two microbatches
      in one (:func:`expert_parallel_s`).
    - ``tensor_host_s`` and ``tensor_token_s`` (for each tensor-parallel degree P of ``gpus`` that fits in a
      node, the job accepts and this machine has the GPUs for; two gloo ranks without CUDA, a host figure
      only): the model tensor-parallel over P GPUs against the same model whole, at one sample and at two
      microbatches in one (:func:`split_parallel_s`); a probe that fails leaves them unmeasured, with a
      warning.
    - ``context_host_s`` and ``context_token_s``: the same for context parallelism over P GPUs (each on its
      shard of the same sequences), for each degree P of ``gpus`` the job accepts.
    """
    from plait.loop.optim import build_optimizer

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    b, par = job.config.batching, job.config.parallel
    mb, seq = b.microbatch_size, b.seq_len
    job_mode = par.activation_checkpointing.mode
    graphs = par.cuda_graphs and device.type == "cuda"

    def one_gpu(mode: str) -> Layout:
        return Layout(1, 1, 1, 1, 1, 1, None, 1, mb, mode)

    with tempfile.TemporaryDirectory() as d:  # first, while this process holds no device memory
        config_file = Path(d) / "job.json"
        config_file.write_text(json.dumps(job.config.model_dump(mode="json", exclude_unset=True)))
        overrides = [*one_gpu(job_mode).overrides(), f"--batching.global_batch_size={mb}"]
        tok_s, allocated, reserved = run_job(config_file, 1, overrides, steps)
        if graphs:  # the memory without them: a graph's replayed tensors are outside the allocator's count
            plain_job = [*overrides, "--parallel.cuda_graphs=false"]
            _, allocated, reserved = run_job(config_file, 1, plain_job, steps)
        # microbatches of one sample, where the host bounds the job: what it adds to each beyond the model
        few = dataclasses.replace(one_gpu(job_mode), microbatch_size=1).overrides()
        few_tok_s = run_job(config_file, 1, [*few, f"--batching.global_batch_size={_FEW}"], steps)[0]
        on_ranks = _rank_figures(job, machine, config_file, gpus)
    host, busy, idle, scale, backward, one_sample = {}, {}, {}, {}, {}, {}
    layer_bytes = mb * sum(job.activation(one_gpu(job_mode)).transient)  # the largest layer's, unchecked
    for mode in dict.fromkeys(("none", *modes, job_mode)):
        ac = par.activation_checkpointing.model_copy(update={"mode": mode})
        model = _built(job, device, activation_checkpointing=ac)
        one = one_sample[mode] = host[mode] = forward_backward_s(model, 1, seq, device)
        # the GPU's busy time at the microbatch (elsewhere than CUDA: the wall time)
        busy[mode] = forward_backward_s(model, mb, seq, device, busy=True)
        if device.type == "cuda":  # the compiled kernels' saves and peak against the meta count
            wall = forward_backward_s(model, mb, seq, device)
            idle[mode] = max(0.0, wall - busy[mode]) if busy[mode] > one else 0.0  # GPU-bound only
            counted = mb * job.stage_activations(one_gpu(mode), 1)[0]
            # under graphs, the same compiled layers launched one kernel at a time: their tensors all counted
            counting = (
                _built(job, device, activation_checkpointing=ac, cuda_graphs=False) if graphs else model
            )
            kept, peak = activation_bytes(counting, mb, seq, device)
            del counting
            scale[mode] = kept / counted
            backward[mode] = (peak - kept) / layer_bytes
        else:  # ops run as issued: a fixed time per microbatch, the rest per sample
            fixed = min(max((mb * one - busy[mode]) / (mb - 1), 0.0), one) if mb > 1 else 0.0
            if fixed >= busy[mode]:  # no time per sample above the noise: all of it counts as compute
                fixed = 0.0
            wall, host[mode], busy[mode] = busy[mode], fixed, busy[mode] - fixed
        if mode == job_mode:
            t_microbatch = wall
            t_optimizer, moved = optimizer_step(build_optimizer(job.config.optimizer, model), device)
        del model
    step_s = max(0.0, mb * seq / tok_s - t_microbatch - t_optimizer)
    per_microbatch = (_FEW * seq / few_tok_s - t_optimizer - step_s) / _FEW
    return dataclasses.replace(
        machine,
        flops=job.flops_per_token * seq * mb / busy["none"],
        host_s=tuple(host.items()),
        idle_s=tuple(idle.items()),
        recompute=tuple((m, t / busy["none"]) for m, t in busy.items()),
        activation_scale=tuple(scale.items()) or machine.activation_scale,
        backward_scale=tuple(backward.items()) or machine.backward_scale,
        optimizer_bytes_per_s=moved / t_optimizer,
        step_s=step_s,
        microbatch_s=max(0.0, per_microbatch - one_sample[job_mode]),
        allocator_slack=(reserved - allocated) * GIB / layer_bytes if allocated else machine.allocator_slack,
        host_overlaps=device.type == "cuda",
        **on_ranks,
    )


def _built(job: PlanJob, device: torch.device, **parallel: Any) -> torch.nn.Module:
    """The job's model as one stage on ``device``, with ``parallel`` changed, compiled afresh (the mode's own
    graphs, each shape's static: :func:`~plait.train.planner.timing.static_shapes`)."""
    provider = job.provider(**parallel)
    model = provider.parallelize(provider.build_stage(0, 1), None)
    provider.materialize(model, device)
    torch.compiler.reset()
    return model


_FEW = 4  # microbatches of one sample in a step that measures the job's own time per microbatch


def _rank_figures(job: PlanJob, machine: Machine, config_file: Path, gpus: int) -> dict[str, Any]:
    """FSDP2's, expert, tensor and context parallelism's figures of ``machine`` (the fields to replace),
    measured by :func:`probe_ranks` on this machine's GPUs for a plan of ``gpus`` (one torchrun launch per
    degree): FSDP2 over min(``gpus``, the GPUs) ranks (one gloo rank without CUDA, whose time is all the
    host's: a CPU runs each op as issued), expert parallelism for each degree P that divides ``gpus`` and the
    experts, tensor and context parallelism for each degree P that divides ``gpus`` and the job accepts
    (tensor parallelism within a node; without CUDA, two gloo ranks); the machine's own for what is not
    measured (FSDP2 when planning for one GPU). A launch that fails with tensor or context parallelism in it
    is run again without them, then with each alone: one that still fails leaves its figures unmeasured, with
    a warning."""
    m, mb, seq = job.model, job.config.batching.microbatch_size, job.config.batching.seq_len
    visible = torch.cuda.device_count()
    moe_layers = sum(map(m.is_moe_layer, range(m.num_hidden_layers)))
    experts = getattr(m, "num_experts", None) or 0
    ep_ranks = [
        p for p in range(2, min(gpus, visible) + 1) if moe_layers and gpus % p == 0 and experts % p == 0
    ]

    def split(p: int, kind: str) -> Layout:  # a layout of P ranks tensor- or context-parallel
        tp = p if kind == "tensor" else 1
        return Layout(1, 1, 1, p // tp, tp, 1, None, 1, mb, "none")

    within = {"tensor": machine.gpus_per_node, "context": gpus}  # tensor parallelism within a node
    split_ranks = {
        kind: [p for p in range(2, min(gpus, visible or 2, within[kind]) + 1)
               if gpus % p == 0 and _accepts(job, split(p, kind))]
        for kind in within
    }  # fmt: skip
    fsdp_ranks = max(1, min(gpus, visible)) if gpus > 1 else 0
    # Every GPU figure at two microbatches in one: what FSDP2, tensor or context parallelism add to the host
    # can keep one microbatch host-bound, and the difference would be priced as GPU work (H200s: a 0.6B Llama
    # context-parallel over two, 88 ms at 8 samples against the model's 46 on its share, 113 ms at 16 against
    # 91; a 0.9B Qwen3-MoE under FSDP2 over two, 15 units at one microbatch: 40 ms of "GPU" time where the
    # job's layout shows ~10)
    samples = 2 * mb if visible else 2
    figures: dict[str, Any] = {}  # what is not measured here keeps the machine's figure (dataclasses.replace)
    named = {f"{kind}_{part}": dict(getattr(machine, f"{kind}_{part}"))
             for kind in ("expert", "tensor", "context") for part in ("host_s", "token_s")}  # fmt: skip
    for p in sorted({*ep_ranks, *split_ranks["tensor"], *split_ranks["context"], fsdp_ranks} - {0}):
        others = {
            "expert_samples": samples if p in ep_ranks else 0,
            "fsdp_samples": samples if p == fsdp_ranks else 0,
        }
        optional = [kind for kind, ranks in split_ranks.items() if p in ranks]
        try:
            runs = [probe_ranks(config_file, p, **others, **{f"{k}_samples": samples for k in optional})]
        except RuntimeError:
            if not optional:
                raise
            runs = [probe_ranks(config_file, p, **others)] if any(others.values()) else []
            for kind in optional:
                try:
                    runs.append(probe_ranks(config_file, p, **{f"{kind}_samples": samples}))
                except RuntimeError as e:  # a model the job accepts so but the probe could not run
                    warnings.warn(f"{kind} parallelism over {p} GPUs was not measured ({e}): its layouts "
                                  "price its collectives' bytes at the bandwidth", stacklevel=2)  # fmt: skip
        for logged in runs:
            log.info("probe over %d GPUs (seconds, slowest rank): %s", p, json.dumps(logged))
        times = runs[0] if runs else {}  # the expert and FSDP2 figures' run, when there are any
        if p in ep_ranks:
            key = f"{job.config.parallel.dispatch}:{p}"
            named["expert_host_s"][key], named["expert_token_s"][key] = expert_parallel_s(
                times, samples, seq, moe_layers
            )
        for kind in optional:
            if run := next((r for r in runs if kind in r), None):  # against the plain model of its own run
                host, gpu = split_parallel_s(run, kind, samples, seq, m.num_hidden_layers)
                named[f"{kind}_host_s"][str(p)] = host
                named[f"{kind}_token_s"][str(p)] = gpu if visible else 0.0  # a CPU's time is all the host's
        if p == fsdp_ranks:
            figures.update(
                (k, v if visible or "gpu" not in k else 0.0) for k, v in fsdp_s(times, samples).items()
            )
            # the size of the units measured: each gathers its parameters whole, over any number of ranks
            probed = job.rank_states(Layout(1, 1, gpus, 1, 1, 1, None, 1, mb, "none"), 1, ((0,),))[0][0]
            figures["fsdp_unit_bytes"] = sum(probed.gathered) / max(1, probed.units)
    return {**figures, **{k: tuple(v.items()) for k, v in named.items()}}


def _accepts(job: PlanJob, layout: Layout) -> bool:
    """Whether the job builds ``layout`` (its model parallelised on meta under a fake group)."""
    try:
        job.rank_states(layout, 1, ((0,),))
    except _REFUSALS:
        return False
    return True
