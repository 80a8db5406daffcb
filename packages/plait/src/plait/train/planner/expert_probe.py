"""What expert parallelism over P GPUs adds to the job's model, measured on those GPUs (``plait plan --calibrate``).

Run by :func:`~plait.train.planner.timing.expert_parallel_s` under ``torchrun --nproc-per-node=P``: every
rank builds the job's model as the job would (compiled and dispatched by its ``parallel`` settings, without
activation checkpointing or data parallelism), once with all experts on every rank and once with them
sharded over the P ranks, and measures each on its own random tokens (the ranks' routings differ as the
job's do): the wall time of a forward and backward of one sample (the host's floor, as ``calibrated``
measures it on one GPU) and of ``--samples`` (enough for the GPU to bound both: its exchanges, their waits
for the other ranks' experts and its own kernels show in the wall time; a profiler's busy time would count
an exchange's kernel waiting on its stream beside the compute). Rank 0 writes the slowest rank's
``{"one": [plain, ep], "many": [plain, ep]}`` in seconds.

    torchrun --nproc-per-node=P -m plait.train.planner.expert_probe --config JOB.json --samples N --out F.json
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from plait.loop import load_config
from plait.models import parallelize
from plait.train.config import JobConfig
from plait.train.job import build_provider
from plait.train.planner.timing import forward_backward_s
from torch.distributed.device_mesh import init_device_mesh


def main(argv: list[str] | None = None) -> None:
    """The probe on this rank (the command line above)."""
    ap = argparse.ArgumentParser(prog="python -m plait.train.planner.expert_probe")
    ap.add_argument("--config", type=Path, required=True, help="the job's config (JSON or TOML)")
    ap.add_argument("--samples", type=int, required=True, help="samples of the larger microbatch")
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
        config = load_config(args.config, [], cls=JobConfig)
        par = config.parallel  # without checkpointing: the planner scales the time by each mode's recompute
        ac = par.activation_checkpointing.model_copy(update={"mode": "none"})
        config = config.model_copy(
            update={"parallel": par.model_copy(update={"activation_checkpointing": ac})}
        )
        mesh = init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("ep_shard",))
        seq = config.batching.seq_len
        times: dict[str, list[float]] = {"one": [], "many": []}
        for expert_mesh in (None, mesh):
            provider = build_provider(config)
            stage = parallelize(provider.build_stage(0, 1), expert_mesh=expert_mesh, config=provider.parallel)
            provider.materialize(stage, device)
            for key, samples in (("one", 1), ("many", args.samples)):
                slowest = torch.tensor(forward_backward_s(stage, samples, seq, device), device=device)
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
                times[key].append(slowest.item())
            del stage
        if dist.get_rank() == 0:
            args.out.write_text(json.dumps(times))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
