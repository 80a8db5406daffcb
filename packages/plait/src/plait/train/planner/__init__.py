"""``plait plan``: every layout a job can run on N GPUs, with its memory per GPU and step time predicted.

:func:`plan` enumerates the candidates (:mod:`~plait.train.planner.layouts`), lets the job's own checks
refuse the invalid ones (the batch plan, the pipeline schedule, the model built and parallelised on meta
under a fake process group of N ranks: :mod:`~plait.train.planner.memory`), and prices each valid one:

- **memory per GPU** (the largest over the pipeline ranks): the sharded parameters, gradients and
  optimizer moments as built (exact); the FSDP2 units gathered at once (all of a stage's units with
  ``reshard_after_forward = false``, else the two largest and the root's); the activations of one
  microbatch per stage (one sample's, :func:`~plait.train.planner.memory.activation_profile`, times the
  microbatch size) times the microbatches the schedule holds in flight (the pipeline simulator's peak);
  the largest layer's activations while a
  checkpointed layer is recomputed; the unsharded gradients and reduce-scatter buffer of the largest
  unit; all times the allocator's fragmentation factor (:class:`~plait.train.planner.timing.Machine`).
- **step time**: each stage's forward (a third of the training FLOPs of its layers, and of the LM head on
  the last stage) and backward (two thirds; a full checkpoint adds a forward, a selective one 30% of a
  forward) at the machine's FLOP/s, divided by the tensor-parallel degree, plus the machine's fixed cost
  of a microbatch (its share of the layers; measured by ``--calibrate``); tensor, context and expert
  parallelism's collectives per microbatch added to the stage's compute (they wait in the layer); the
  pipeline simulator composes the stages with the schedule's program and the send/recv time; FSDP2's
  all-gathers and reduce-scatters hide behind the compute except the first unit's gather and the last
  unit's reduce-scatter and whatever exceeds the compute; HSDP's replica all-reduce and the optimizer
  step (bytes moved at the machine's rate) follow.

The table ranks the layouts that fit by predicted tokens per second per GPU and says what limits each:
``memory`` (within 10% of the GPU), ``bubble`` (the simulator's idle share above 15%), ``communication``
(exposed collectives above 20% of the step) or ``compute``.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from plait.loop import BatchPlan, ConfigError, load_config, split_cli_overrides
from plait.pipelining import ActionCosts, build_program, lower, simulate
from plait.train.config import JobConfig
from plait.train.planner.layouts import CHECKPOINTING, Layout, candidate_layouts
from plait.train.planner.memory import (
    ActivationProfile,
    StateBytes,
    activation_profile,
    context,
    fake_world,
    state_bytes,
)
from plait.train.planner.timing import Machine, calibrate, load_machine

__all__ = ["Layout", "Machine", "Plan", "PlanJob", "Prediction", "main", "plan"]

GIB = 2**30
_SELECTIVE_RECOMPUTE = 0.3  # share of a layer's forward that selective checkpointing recomputes


@dataclass(frozen=True)
class Prediction:
    """One valid layout, priced.

    Attributes:
        layout: the layout.
        step_s: predicted seconds per optimizer step.
        tokens_per_s_per_gpu: the global batch's tokens per second, per GPU.
        peak_bytes: predicted peak memory of the fullest GPU.
        limit: what bounds it: ``memory``, ``bubble``, ``communication`` or ``compute``.
        memory: the peak's parts (bytes) on the fullest pipeline rank.
        time: the step's parts (seconds).
        num_stages: the model's pipeline stages.
    """

    layout: Layout
    step_s: float
    tokens_per_s_per_gpu: float
    peak_bytes: float
    limit: str
    memory: dict[str, float] = field(default_factory=dict)
    time: dict[str, float] = field(default_factory=dict)
    num_stages: int = 1


@dataclass(frozen=True)
class Plan:
    """The priced layouts (fastest first), those over the GPU's memory, why the others were refused, and
    how many valid-looking layouts were ranked below those built exactly (``unverified``)."""

    gpus: int
    machine: Machine
    fits: list[Prediction]
    too_big: list[Prediction]
    refused: Counter[str]
    unverified: int = 0


RankStates = list[tuple[StateBytes, dict[int, list[int]]]]  # per pipeline rank: states, layers per stage


def state_key(layout: Layout, num_stages: int) -> tuple[int, ...]:
    """What a layout's model states depend on (FSDP shards over data x context ranks alike)."""
    return (layout.pp, num_stages, layout.dp_replicate, layout.dp_shard * layout.cp, layout.tp, layout.ep)


class PlanJob:
    """The job's config and what the planner builds from it, cached across layouts."""

    def __init__(self, config: JobConfig) -> None:
        from plait.train.job import build_provider

        if config.model is None:
            raise ConfigError("plait plan: no [model] section")
        self.config = config
        self.model = config.model
        self.build_provider = build_provider
        self.states: dict[tuple[Any, ...], RankStates | str] = {}
        self._inventory: dict[str, Any] | None = None
        self.programs: dict[tuple[Any, ...], Any] = {}
        self.flops_per_token = float(self.provider().flops_per_token(config.batching.seq_len))
        self.activations: dict[tuple[int, str], ActivationProfile] = {}

    def schedule(self, batch_plan: BatchPlan, layout: Layout) -> tuple[Any, int, Callable[[int], list[int]]]:
        """The layout's lowered pipeline program (None without pipelining), stage count and stages per rank.

        Raises:
            ValueError: the schedule refuses the layout (its own checks).
        """
        if layout.pp == 1:
            return None, 1, lambda p: [0]
        options = layout.pipeline_options()
        key = (tuple(sorted((options or {}).items())), layout.pp, batch_plan.num_microbatches)
        if key not in self.programs:
            try:
                schedule = batch_plan.schedule(options)
                topo = schedule.topology(layout.pp)
                placement = {p: sorted(topo.stages_of(p)) for p in range(layout.pp)}
                self.programs[key] = (lower(build_program(schedule, layout.pp)), topo.num_stages, placement)
            except ValueError as e:
                self.programs[key] = f"ValueError: {str(e).splitlines()[0][:160]}"
        cached = self.programs[key]
        if isinstance(cached, str):
            raise ValueError(cached.removeprefix("ValueError: "))
        program, num_stages, placement = cached
        return program, num_stages, placement.__getitem__

    def provider(self, **parallel: Any) -> Any:
        cfg = self.config.model_copy(update={"parallel": self.config.parallel.model_copy(update=parallel)})
        return self.build_provider(cfg)

    def rank_states(
        self, layout: Layout, num_stages: int, stages_of: Callable[[int], list[int]]
    ) -> RankStates:
        """Per pipeline rank: its state bytes and the decoder layers of each of its stages, from the job's
        model built and parallelised on meta under a fake group (:mod:`~plait.train.planner.memory`).

        Raises:
            ValueError: the job's plan refuses the layout (the message says why).
        """
        key = state_key(layout, num_stages)
        if key not in self.states:
            provider = self.provider(compile=False)
            per_rank: RankStates = []
            try:
                for p in range(layout.pp):
                    rank = p * (layout.world // layout.pp)
                    with fake_world(layout.world, rank):
                        ctx = context(layout.mesh(), rank)
                        indices = stages_of(p)
                        stages = [
                            provider.parallelize(provider.build_stage(s, num_stages), ctx) for s in indices
                        ]
                        layers = {
                            i: [ly.layer_idx for ly in st.decoder_layers()] for i, st in zip(indices, stages)
                        }
                        states = state_bytes(stages, self.config.optimizer)
                    per_rank.append((states, layers))
            except (ValueError, NotImplementedError, RuntimeError, AssertionError) as e:
                self.states[key] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            else:
                self.states[key] = per_rank
        result = self.states[key]
        if isinstance(result, str):
            raise ValueError(result)
        return result

    def estimated_states(
        self, layout: Layout, num_stages: int, stages_of: Callable[[int], list[int]]
    ) -> RankStates:
        """:meth:`rank_states` estimated from the unsharded model's parameters (dense ones split over tensor
        and FSDP ranks, experts over expert and their FSDP ranks): the first pass's ranking only."""
        inv = self.inventory()
        per_stage = self.model.num_hidden_layers / num_stages
        fsdp = layout.dp_shard * layout.cp
        expert_fsdp = max(1, layout.dp * layout.cp // layout.ep) if layout.ep > 1 else fsdp
        ratio = inv["optimizer_ratio"]
        per_rank: RankStates = []
        for p in range(layout.pp):
            indices = stages_of(p)
            by_stage = {
                s: [i for i in range(self.model.num_hidden_layers) if int(i // per_stage) == s]
                for s in indices
            }
            layers = [i for ly in by_stage.values() for i in ly]
            first, last = 0 in indices, num_stages - 1 in indices
            dense = sum(inv["dense"][i] for i in layers) + inv["embed"] * first + inv["head"] * last
            experts = sum(inv["experts"][i] for i in layers)
            local = dense / layout.tp / fsdp + experts / layout.ep / expert_fsdp
            units = [inv["dense"][i] / layout.tp + inv["experts"][i] / layout.ep for i in layers]
            units.append((inv["embed"] * first + inv["head"] * last) / layout.tp)
            states = StateBytes(
                int(local), int(local * inv["trainable"]), int(local * ratio), tuple(int(u) for u in units)
            )
            per_rank.append((states, by_stage))
        return per_rank

    def inventory(self) -> dict[str, Any]:
        """Parameter bytes of the unsharded model: per layer (dense, experts), the embedding, the rest (head,
        final norm); the trainable share and the optimizer's bytes per parameter byte."""
        if self._inventory is None:
            model = self.provider(compile=False).build_stage(0, 1)
            n = self.config.model.num_hidden_layers  # type: ignore[union-attr]
            dense, experts = [0] * n, [0] * n
            embed = head = trainable = total = 0
            for name, q in model.named_parameters():
                nbytes = q.numel() * q.element_size()
                total += nbytes
                trainable += nbytes * q.requires_grad
                if ".layers." in name:
                    i = int(name.split(".layers.")[1].split(".")[0])
                    (experts if ".experts." in name else dense)[i] += nbytes
                elif "embed" in name:
                    embed += nbytes
                else:
                    head += nbytes
            states = state_bytes([model], self.config.optimizer)
            self._inventory = {
                "dense": dense, "experts": experts, "embed": embed, "head": head,
                "trainable": trainable / max(total, 1), "optimizer_ratio": states.optimizer / max(total, 1),
            }  # fmt: skip
        return self._inventory

    def activation(self, layout: Layout, *, exact: bool = True) -> ActivationProfile:
        """One sample's activations on a rank of ``layout`` (the first pass scales the whole sequence's by the
        context-parallel degree instead of measuring each shard length)."""
        if not exact and layout.cp > 1:
            return self.activation(dataclasses.replace(layout, cp=1)).scaled(1 / layout.cp)
        seq = self.config.batching.seq_len // layout.cp
        key = (seq, layout.checkpointing)
        if key not in self.activations:
            ac = self.config.parallel.activation_checkpointing

            def build(mode: str) -> torch.nn.Module:
                provider = self.provider(
                    compile=False, activation_checkpointing=ac.model_copy(update={"mode": mode, "every": 1})
                )
                return provider.parallelize(provider.build_stage(0, 1), None)

            self.activations[key] = activation_profile(
                build, layout.checkpointing, ac.save_ops, 1, seq,
                self.model.hidden_size, self.model.num_hidden_layers,
            )  # fmt: skip
        return self.activations[key]


def _comm_per_microbatch(job: PlanJob, layout: Layout, machine: Machine, layers: list[int]) -> float:
    """Tensor, context and expert parallelism's collectives of one microbatch of a stage (forward and
    backward): they wait inside the layers."""
    m, b = job.model, job.config.batching
    tokens = layout.microbatch_size * b.seq_len // layout.cp
    act = tokens * m.hidden_size * 2  # bf16 activations
    s = 0.0
    if layout.tp > 1:  # two all-reduces per layer forward, two in the backward
        s += 4 * len(layers) * machine.collective_s("all_reduce", act, layout.tp)
    if layout.cp > 1:  # keys and values gathered in the forward, their gradients reduce-scattered back
        kv = 2 * layout.microbatch_size * b.seq_len * m.kv_heads * m.resolved_head_dim * 2 // layout.tp
        s += len(layers) * 2 * machine.collective_s("all_gather", kv, layout.cp)
    experts = getattr(m, "num_experts", None)
    if layout.ep > 1 and experts:
        k = getattr(m, "num_experts_per_tok", 1)
        if job.config.parallel.expert_dispatch == "all_gather":
            each = 2 * (machine.collective_s("all_gather", act * layout.ep, layout.ep)
                        + machine.collective_s("reduce_scatter", act * layout.ep, layout.ep))  # fmt: skip
        else:
            each = 4 * machine.collective_s("all_to_all", act * k, layout.ep)
        s += len(layers) * each
    return s


def predict(job: PlanJob, layout: Layout, machine: Machine, *, exact: bool = True) -> Prediction | str:
    """The prediction of ``layout``, or why the job refuses it; ``exact=False`` estimates the model states
    instead of building them (the first pass of :func:`plan`)."""
    cfg, m = job.config, job.model
    try:
        batch_plan = BatchPlan(cfg.batching.global_batch_size, layout.microbatch_size, layout.dp,
                               cfg.batching.seq_len, layout.cp)  # fmt: skip
        nmb = batch_plan.num_microbatches
        program, num_stages, stages_of = job.schedule(batch_plan, layout)
        if num_stages > m.num_hidden_layers:
            return f"{num_stages} stages for {m.num_hidden_layers} layers"
        ranks = (job.rank_states if exact else job.estimated_states)(layout, num_stages, stages_of)
        acts = job.activation(layout, exact=exact)
    except (ValueError, NotImplementedError, RuntimeError, ConfigError, AssertionError) as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"

    seq = cfg.batching.seq_len
    tokens_mb = layout.microbatch_size * seq // layout.cp
    flops_token = job.flops_per_token
    head_flops = 6 * m.hidden_size * m.vocab_size
    layer_flops = (flops_token - head_flops) / m.num_hidden_layers
    extra_bwd = {"none": 0.0, "selective": _SELECTIVE_RECOMPUTE, "full": 1.0}[layout.checkpointing]

    def stage_costs(layers: list[int], last: bool) -> tuple[float, float, float]:
        flops = (layer_flops * len(layers) + head_flops * last) * tokens_mb / layout.tp
        fixed = machine.microbatch_s * len(layers) / m.num_hidden_layers  # a third of it in the forward
        fwd = flops / 3 / machine.flops + fixed / 3
        comm = _comm_per_microbatch(job, layout, machine, layers)
        return fwd + comm / 2, (2 + extra_bwd) * fwd + comm / 2, comm

    stage_layers = {s: ly for _, by_stage in ranks for s, ly in by_stage.items()}
    stage_flags = {s: (s == 0, s == num_stages - 1) for s in stage_layers}
    # one sample's activations times the microbatch (every saved tensor is per sample)
    mb = layout.microbatch_size
    act_bytes = {s: float(mb * acts.stage(ly, *stage_flags[s], layout.tp)) for s, ly in stage_layers.items()}
    costs = {s: stage_costs(ly, stage_flags[s][1]) for s, ly in stage_layers.items()}
    tp_comm = sum(c[2] for c in costs.values()) * nmb / layout.pp
    p2p = machine.collective_s("send_recv", tokens_mb * m.hidden_size * 2, 2) if layout.pp > 1 else 0.0
    if program is None:
        f, b, _ = costs[0]
        compute_s, bubble, peak_acts = nmb * (f + b), 0.0, [act_bytes[0]]
    elif not exact:  # the first pass: the bubble of a 1F1B-like schedule, its activations in flight
        slowest = max(f + b for f, b, _ in costs.values()) * len(stage_layers) / layout.pp
        compute_s = (nmb + (layout.pp - 1) / layout.stages_per_rank) * slowest
        bubble = 1 - nmb * slowest / compute_s
        inflight = nmb if layout.schedule == "gpipe" else min(nmb, layout.pp)
        peak_acts = [inflight * sum(act_bytes[s] for s in by_stage) / len(by_stage) for _, by_stage in ranks]
    else:
        result = simulate(program, ActionCosts(comm=p2p), stage_costs={
            s: ActionCosts(forward=f, backward=b, backward_input=b / 2, backward_weight=b / 2, comm=p2p,
                           activation_memory=act_bytes[s])
            for s, (f, b, _) in costs.items()
        })  # fmt: skip
        compute_s, bubble, peak_acts = result.step_time, result.bubble_fraction, list(result.peak_activations)

    # FSDP2: gathers per microbatch unless parameters stay gathered; one reduce-scatter per step
    fsdp_n = layout.dp_shard * layout.cp
    reshard = cfg.parallel.reshard_after_forward is not False
    gathers = (2 * nmb if reshard else 1) if fsdp_n > 1 else 0
    units = ranks[0][0].gathered
    ag = [machine.collective_s("all_gather", u, fsdp_n) for u in units]
    rs = [machine.collective_s("reduce_scatter", u, fsdp_n) for u in units]
    fsdp_total = sum(ag) * gathers + sum(rs) if fsdp_n > 1 else 0.0
    fsdp_exposed = (ag[0] + rs[-1] + max(0.0, fsdp_total - compute_s)) if fsdp_n > 1 and units else 0.0
    states0 = ranks[0][0]
    replica = machine.collective_s(
        "all_reduce", states0.grads, layout.dp_replicate, inter_node=layout.world > machine.gpus_per_node
    )
    optimizer_s = (2 * states0.params + states0.grads + 2 * states0.optimizer) / machine.optimizer_bytes_per_s
    step = compute_s + fsdp_exposed + replica + optimizer_s
    tok_s = cfg.batching.global_batch_size * seq / step / layout.world

    # memory of the fullest pipeline rank
    best: dict[str, float] = {}
    for p, (states, _) in enumerate(ranks):
        gathered = sorted(states.gathered)
        inflight = (
            sum(gathered)
            if not reshard
            else sum(gathered[-2:]) + (states.gathered[-1] if states.gathered else 0)
        )
        biggest = gathered[-1] if gathered else 0
        parts = {
            "params": float(states.params), "grads": float(states.grads), "optimizer": float(states.optimizer),
            "gathered": float(inflight if fsdp_n > 1 else 0), "activations": float(peak_acts[p]),
            "recompute": float(mb * acts.split(acts.transient, layout.tp)), "reduce_buffers": float(2 * biggest if fsdp_n > 1 else 0),
        }  # fmt: skip
        if sum(parts.values()) > sum(best.values()):
            best = parts
    peak = sum(best.values()) * machine.fragmentation
    exposed = tp_comm + fsdp_exposed + replica
    if peak > 0.9 * machine.memory_gib * GIB:
        limit = "memory"
    elif bubble > 0.15:
        limit = "bubble"
    elif exposed > 0.2 * step:
        limit = "communication"
    else:
        limit = "compute"
    times = {"compute_and_pipeline": compute_s, "bubble_fraction": bubble, "tp_cp_ep_comm": tp_comm,
             "fsdp_exposed": fsdp_exposed, "replica_all_reduce": replica, "optimizer": optimizer_s}  # fmt: skip
    return Prediction(layout, step, tok_s, peak, limit, best, times, num_stages)


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

    Two passes: every candidate is priced with estimated model states, then the layouts of the
    ``exact_limit`` most promising distinct meshes (all of them when there are no more; fitting ones
    first, fastest first) are built under the fake group and priced exactly. Only exactly priced layouts
    are listed; the others are counted in ``Plan.unverified``.
    """
    machine = machine or Machine()
    job = job or PlanJob(config)
    experts = getattr(config.model, "num_experts", None)
    refused = Counter[str]()
    coarse: dict[tuple[int, ...], list[tuple[Layout, Prediction]]] = {}
    for layout in candidate_layouts(
        gpus, global_batch_size=config.batching.global_batch_size, num_experts=experts,
        gpus_per_node=machine.gpus_per_node, checkpointing=checkpointing,
    ):  # fmt: skip
        result = predict(job, layout, machine, exact=False)
        if isinstance(result, str):
            refused[result] += 1
            continue
        coarse.setdefault(state_key(layout, result.num_stages), []).append((layout, result))

    def promise(key: tuple[int, ...]) -> tuple[bool, float]:
        best = max(coarse[key], key=lambda lp: lp[1].tokens_per_s_per_gpu)[1]
        return (best.peak_bytes > machine.memory_gib * GIB, -best.tokens_per_s_per_gpu)

    keys = sorted(coarse, key=promise)
    fits, too_big = [], []
    for key in keys[:exact_limit]:
        for layout, _ in coarse[key]:
            result = predict(job, layout, machine)
            if isinstance(result, str):
                refused[result] += 1
            elif result.peak_bytes > machine.memory_gib * GIB:
                too_big.append(result)
            else:
                fits.append(result)
    fits.sort(key=lambda r: -r.tokens_per_s_per_gpu)
    too_big.sort(key=lambda r: r.peak_bytes)
    unverified = sum(len(coarse[k]) for k in keys[exact_limit:])
    return Plan(gpus, machine, fits, too_big, refused, unverified)


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


def main(argv: list[str] | None = None) -> None:
    """``plait plan --config F --gpus N [--gpus-per-node M] [--gpu-memory GiB] [--calibrate] [--machine J]
    [--explain LAYOUT] [--top K] [--section.key=value ...]``."""
    import sys

    from plait.train.train import DEFAULT_CONFIG

    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(prog="plait plan", description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument(
        "--config", type=Path, default=DEFAULT_CONFIG, help="the job's config (default: embedded)"
    )
    ap.add_argument("--gpus", type=int, required=True, help="GPUs to plan for")
    ap.add_argument("--gpus-per-node", type=int, help="GPUs per node (default: min(gpus, 8))")
    ap.add_argument("--gpu-memory", type=float, help="GiB per GPU (default: the machine's, 139.8)")
    ap.add_argument("--machine", type=Path, help="JSON of timing.Machine fields (rates, bandwidths)")
    ap.add_argument("--calibrate", action="store_true", help="time the job's model on this machine's device")
    ap.add_argument("--checkpointing", default=",".join(CHECKPOINTING), help="modes to consider")
    ap.add_argument("--top", type=int, default=15, help="rows of the table")
    ap.add_argument("--explain", metavar="LAYOUT", help="the breakdown of one layout (its name in the table)")
    overrides, rest = split_cli_overrides(argv)
    args = ap.parse_args(rest)
    if args.gpus < 1:
        raise SystemExit("plait plan: --gpus must be >= 1")
    try:
        config = load_config(args.config, overrides, cls=JobConfig)
        machine = load_machine(args.machine, args.gpu_memory)
        modes = tuple(args.checkpointing.split(","))
        if bad := [x for x in modes if x not in CHECKPOINTING]:
            raise ValueError(
                f"--checkpointing: unknown mode(s) {bad} (choose from {', '.join(CHECKPOINTING)})"
            )
    except (ConfigError, ValueError) as e:
        raise SystemExit(f"plait plan: error: {e}") from None
    machine = dataclasses.replace(machine, gpus_per_node=args.gpus_per_node or min(args.gpus, 8))
    job = PlanJob(config)
    if args.calibrate:
        machine = calibrated(job, machine)
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
        return
    if result.too_big:
        need = result.too_big[0]
        print(f"nothing fits in {machine.memory_gib:g} GiB: the smallest layout needs {need.peak_bytes / GIB:.3g} GiB "
              f"({need.layout.name}); " + _smallest_fit(config, args.gpus, machine, job))  # fmt: skip
    else:
        print("no layout is valid: " + "; ".join(f"{k} ({n}x)" for k, n in result.refused.most_common(5)))
    raise SystemExit(1)


def calibrated(job: PlanJob, machine: Machine) -> Machine:
    """``machine`` with the rate and the fixed cost per microbatch of the job's model (one stage) timed
    forward and backward on this device (:func:`~plait.train.planner.timing.calibrate`)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    provider = job.provider()
    model = provider.parallelize(provider.build_stage(0, 1), None)
    provider.materialize(model, device)
    b = job.config.batching
    flops, fixed = calibrate(model, provider.flops_per_token(b.seq_len), b.microbatch_size, b.seq_len, device)
    return dataclasses.replace(machine, flops=flops, microbatch_s=fixed)
