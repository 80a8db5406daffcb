"""What FSDP2, expert, tensor and context parallelism over P GPUs add to the job's model, measured on those
GPUs (``plait plan --calibrate``).

Run by :func:`~plait.train.planner.timing.probe_ranks` under ``torchrun --nproc-per-node=P``: every rank builds
the job's model as the job would (compiled and dispatched by its ``parallel`` settings, without activation
checkpointing; each variant compiled afresh, one static graph per batch size as the job's:
:func:`~plait.train.planner.timing.static_shapes`) and times a forward and backward on its own random tokens
(the ranks' routings differ as the job's do; a tensor- or context-parallel group's ranks share theirs), of
one sample (the host's floor, as ``calibrated`` measures it on one GPU) and of more (enough for the GPU to
bound the model: the collectives, their waits for the other ranks and their kernels beside the compute show
in the wall time; a profiler's busy time would count a collective's kernel waiting on its stream beside the
compute). The variants:

- ``plain``: every parameter and expert on every rank, at one sample and at each count below; built and
  timed at one sample again after the others (a count timed twice keeps its faster time: every host figure
  is taken against this floor, and one slow timing of it would shrink them all);
- ``experts`` (``--expert-samples N``): the experts sharded over the P ranks, at one sample and at N;
- ``fsdp`` (``--fsdp-samples M``): FSDP2 over the P ranks with the job's units and resharding, at one
  sample, at M and on a GPU also at the job's microbatch, where FSDP2's host may still bound it (a wall time
  bounds the host's floor from above at any count: the planner takes the lowest); a microbatch that reduces
  its gradients (a step's last);
- ``fsdp_accumulating``: the same counts, as the job runs the microbatches before a step's last
  (:class:`~plait.pipelining.GradientSync` of the offline executor: gradients accumulated unreduced,
  ``fsdp.gather_once_per_step`` honoured);
- ``tensor`` (``--tensor-samples K``): tensor parallelism over the P ranks (every rank on the same tokens, as
  a tensor-parallel group's are), at one sample and at K;
- ``context`` (``--context-samples C``): context parallelism over the P ranks (every rank on its shard of the
  same sequences, in the load-balanced layout the job feeds it), at one sample and at C.

Rank 0 writes the slowest rank's seconds, ``{"ranks": P, "plain": {"1": s, "M": s, "N": s}, "experts":
{...}, "fsdp": {...}, "fsdp_accumulating": {...}, "tensor": {...}, "context": {...}, "fsdp_units": units,
"slack": {"fsdp": bytes}}`` (``fsdp_units``: the units that gather parameters, as the planner counts them;
``slack``: on a GPU, the largest bytes a rank's allocator held reserved above the allocated ones under FSDP2
at one sample, its own floor: a sample's activations are small).

    torchrun --nproc-per-node=P -m plait.train.planner.rank_probe --config JOB.json
        [--expert-samples N] [--fsdp-samples M] [--tensor-samples K] [--context-samples C] --out F.json
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from plait.dist_core.fsdp_state import param_groups
from plait.loop import load_config
from plait.models import DecoderStage, parallelize
from plait.models.common.parallel import apply_data_parallel
from plait.pipelining import GradientSync
from plait.train.config import JobConfig
from plait.train.job import build_provider
from plait.train.planner.timing import forward_backward_s, static_shapes
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule


def main(argv: list[str] | None = None) -> None:
    """The probe on this rank (the command line above)."""
    ap = argparse.ArgumentParser(prog="python -m plait.train.planner.rank_probe")
    ap.add_argument("--config", type=Path, required=True, help="the job's config (JSON or TOML)")
    ap.add_argument(
        "--expert-samples", type=int, default=0, help="time the experts sharded at this many samples"
    )
    ap.add_argument("--fsdp-samples", type=int, default=0, help="time FSDP2 at this many samples")
    ap.add_argument(
        "--tensor-samples", type=int, default=0, help="time tensor parallelism at this many samples"
    )
    ap.add_argument(
        "--context-samples", type=int, default=0, help="time context parallelism at this many samples"
    )
    ap.add_argument("--out", type=Path, required=True, help="rank 0 writes the times here (JSON)")
    args = ap.parse_args(argv)
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:  # the CPU's gloo ranks: the tests
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    try:
        _probe(args, device)
    finally:
        dist.destroy_process_group()


@static_shapes()
def _probe(args: argparse.Namespace, device: torch.device) -> None:
    """Every variant the command line asks for, timed; rank 0 writes the times."""
    config = load_config(args.config, [], cls=JobConfig)
    par = config.parallel  # without checkpointing: the planner scales the time by each mode's recompute
    ac = par.activation_checkpointing.model_copy(update={"mode": "none"})
    config = config.model_copy(update={"parallel": par.model_copy(update={"activation_checkpointing": ac})})
    ranks, seq = dist.get_world_size(), config.batching.seq_len
    times: dict[str, Any] = {"ranks": ranks}

    def slowest(value: float) -> float:
        t = torch.tensor(value, dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()

    def timed(variant: str, stage: torch.nn.Module, *counts: int, fresh: bool = True) -> None:
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        if fresh:
            provider.materialize(stage, device)
            torch.compiler.reset()  # the variant's own graphs (static_shapes)
        # the tokens: a rank's own, or under tensor and context parallelism the group's
        torch.manual_seed(0 if variant in ("tensor", "context") else dist.get_rank())
        shard = (ranks, dist.get_rank()) if variant == "context" else None
        timings = times.setdefault(variant, {})
        for samples in sorted({1, *counts}):  # one sample first, always: the host's floor
            t = slowest(forward_backward_s(stage, samples, seq, device, context=shard))
            timings[str(samples)] = min(t, timings.get(str(samples), t))  # timed twice: the faster
            if samples == 1 and device.type == "cuda" and variant == "fsdp":
                held = torch.cuda.max_memory_reserved(device) - torch.cuda.max_memory_allocated(device)
                times.setdefault("slack", {})[variant] = slowest(held)

    provider = build_provider(config)

    def mesh(dim: str) -> DeviceMesh:  # the P ranks as one mesh dimension
        return init_device_mesh(device.type, (ranks,), mesh_dim_names=(dim,))

    def build(dense: str = "", expert: str = "", cp: str = "") -> DecoderStage:
        """The job's model, parallel over the P ranks as the meshes named (dense: tensor, expert, context)."""
        dense_mesh, expert_mesh, cp_mesh = (mesh(dim) if dim else None for dim in (dense, expert, cp))
        return parallelize(provider.build_stage(0, 1), dense_mesh=dense_mesh, expert_mesh=expert_mesh,
                           cp_mesh=cp_mesh, config=provider.parallel)  # fmt: skip

    counts = (args.expert_samples, args.fsdp_samples, args.tensor_samples, args.context_samples)
    stage: torch.nn.Module | None = None
    timed("plain", build(), *(n for n in counts if n))
    if args.expert_samples:
        stage = build(expert="ep_shard")
        timed("experts", stage, args.expert_samples)
    if args.fsdp_samples:  # FSDP2 as the job applies it, over a mesh of any size (one rank too)
        stage = build()
        apply_data_parallel(stage, mesh("dp_cp_shard"), provider.parallel)
        # the units that gather parameters, as the plan counts them (on one rank too, where the plan's
        # state_bytes sees nothing to gather)
        units = [m for m in stage.modules() if isinstance(m, FSDPModule)]
        times["fsdp_units"] = sum(any(g.fsdp_params for g in param_groups(m)) for m in units)
        # on a GPU also at the job's microbatch: FSDP2's host may bound it (a CPU's time is all the host's)
        fsdp_counts = (args.fsdp_samples, config.batching.microbatch_size if device.type == "cuda" else 1)
        timed("fsdp", stage, *fsdp_counts)
        sync = GradientSync({0: stage}, has_backward=True, splits_backward=False, schedule="offline",
                            finalize=False, gather_once=config.fsdp.gather_once_per_step)  # fmt: skip
        sync.start()  # every microbatch now one before the step's last: none reduces
        timed("fsdp_accumulating", stage, *fsdp_counts, fresh=False)
        sync.finish()
    if args.tensor_samples:
        stage = build(dense="tp")
        timed("tensor", stage, args.tensor_samples)
    if args.context_samples:
        stage = build(cp="cp")
        timed("context", stage, args.context_samples)
    if stage is not None:  # the plain model's floor again, built afresh: the host figures' common term
        stage = None
        timed("plain", build())
    if dist.get_rank() == 0:
        args.out.write_text(json.dumps(times))


if __name__ == "__main__":
    main()
