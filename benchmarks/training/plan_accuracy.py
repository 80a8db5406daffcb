"""How close ``plait plan`` comes to real runs: predicted against measured tok/s per GPU and peak memory.

    python3 -m benchmarks.training.plan_accuracy --config examples/qwen3_moe/configs/gpu1.toml --gpus 1 \
        --set parallel.cuda_graphs=false
    python3 -m benchmarks.training.plan_accuracy --config F --gpus 4 --layouts 12 --calibrate --out results/plan_accuracy.md
    python3 -m benchmarks.training.plan_accuracy --config F --gpus 2 --calibrate --only "fsdp2 mb8 ac-none" \
        --set parallel.fsdp_layers_per_unit=4 --set parallel.reshard_after_forward=false

Plans the job on ``--gpus`` GPUs (with ``--calibrate``: the job measured on this machine's GPU first, as
``plait plan --calibrate`` does: its model's rate and fixed costs, its optimizer, FSDP2's cost per unit, a
few steps of one microbatch; each rank probe's raw times printed, the ``plait.plan`` logger at INFO), then
runs ``--layouts`` of the layouts that fit (the fastest predicted ones, then every k-th of the rest, so that
the table spans the ranking) with ``plait train`` on that many GPUs for ``--steps`` steps, no checkpoints,
no export, no evaluation. Measured: the last logging interval's tokens per second per GPU (the first
interval holds the compile) and the main rank's peak allocated and reserved memory (the error is against the
reserved bytes, which is what runs out: the planner's peak includes the allocator's slack, measured by
``--calibrate``; with pipeline stages the planner's figure is the one of that rank, the first pipeline rank,
not of the fullest).
Prints and writes (``--out``) one row per layout: predicted, measured, the error of each, and whether the
planner's first pick is within 5% of the fastest measured layout. ``--only`` runs the named layouts (as
``plait plan`` names them) instead; ``--set section.key=value`` changes the job for the planner and every run
alike (e.g. FSDP's unit size, which the planner prices but does not choose). ``--save-machine F`` writes the
planner's machine (calibrated or not) and ``--machine F`` starts from one, so a later run on the same machine
can skip ``--calibrate``. ``gpu1.toml`` replays its layers as CUDA graphs, which allow FSDP and expert
parallelism (the ``all_gather`` dispatch, which the graphs take by default) only: the planner lists no other
layout; the tables of
``results/plan_accuracy.md`` after its first were measured before the config turned them on, and ``--set
parallel.cuda_graphs=false`` runs those jobs.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import logging
import shlex
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, required=True)
    ap.add_argument("--gpus", type=int, default=1)
    ap.add_argument("--layouts", type=int, default=12, help="layouts to run")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--calibrate", action="store_true", help="time the job's model on this GPU first")
    ap.add_argument("--checkpointing", default="none,selective,full")
    ap.add_argument("--only", help="comma-separated layout names to run instead of --layouts")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="a config override for the planner and the runs (repeatable)")  # fmt: skip
    ap.add_argument("--out", type=Path, help="markdown table to write")
    ap.add_argument(
        "--save-machine", type=Path, help="the planner's machine (as calibrated) as JSON, for --machine"
    )
    ap.add_argument("--machine", type=Path, help="start from a saved machine (JSON) instead of the defaults")
    args = ap.parse_args()

    from plait.loop import load_config
    from plait.train.config import JobConfig
    from plait.train.planner import PlanJob, calibrated, plan
    from plait.train.planner.timing import load_machine, run_job

    overrides = [f"--{o}" for o in args.set]
    config = load_config(args.config, overrides, cls=JobConfig)
    job = PlanJob(config)
    machine = dataclasses.replace(load_machine(args.machine, None), gpus_per_node=args.gpus)
    if torch.cuda.is_available():
        machine = dataclasses.replace(
            machine, memory_gib=torch.cuda.get_device_properties(0).total_memory / 2**30
        )
    if args.calibrate:
        # the probes' raw times printed as they come (the planner's figures are taken from them)
        probes = logging.getLogger("plait.plan")
        probes.setLevel(logging.INFO)
        probes.addHandler(logging.StreamHandler(sys.stdout))
        machine = calibrated(job, machine, modes=tuple(args.checkpointing.split(",")), gpus=args.gpus)
        print("calibrated: " + machine.measured(), flush=True)
    if args.save_machine:
        args.save_machine.write_text(machine.to_json() + "\n")
    result = plan(config, args.gpus, machine, checkpointing=tuple(args.checkpointing.split(",")), job=job)
    fits = result.fits
    if args.only:
        by_name = {p.layout.name: p for p in fits}
        names = args.only.split(",")
        if missing := [n for n in names if n not in by_name]:
            sys.exit(f"--only: no fitting layout named {', '.join(missing)}")
        chosen = [by_name[n] for n in names]
    else:
        step = max(1, (len(fits) - args.layouts // 2) // max(1, args.layouts - args.layouts // 2))
        chosen = (fits[: args.layouts // 2] + fits[args.layouts // 2 :: step])[: args.layouts]
    rows, measured = [], {}
    for p in chosen:
        name = p.layout.name
        try:
            tok, allocated, reserved = run_job(
                args.config, args.gpus, [*overrides, *p.layout.overrides()], args.steps, cwd=ROOT
            )
        except RuntimeError as e:
            rows.append(
                f"| {name} | {p.tokens_per_s_per_gpu:,.0f} | failed: {e} | | {p.first_rank_peak_bytes / 2**30:.2f} | | | |"
            )
            continue
        measured[name] = tok
        gib = p.first_rank_peak_bytes / 2**30
        memory = (
            f"{allocated:.2f} | {reserved:.2f} | {gib / reserved - 1:+.0%}"
            if reserved
            else "n/a (no CUDA) | |"
        )
        rows.append(
            f"| {name} | {p.tokens_per_s_per_gpu:,.0f} | {tok:,.0f} | {p.tokens_per_s_per_gpu / tok - 1:+.0%} "
            f"| {gib:.2f} | {memory} |"
        )
        print(rows[-1], flush=True)
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    lines = [
        "# plait plan: predicted against measured",
        "",
        f"**device:** {args.gpus} x {device}, torch {torch.__version__}, "
        f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; planner"
        f" ({'calibrated' if args.calibrate else f'from {args.machine}' if args.machine else 'default'}): "
        f"{machine.measured()}",
        "",
        f"**command:** `python3 -m benchmarks.training.plan_accuracy {shlex.join(sys.argv[1:])}`",
        "",
        "| layout | predicted tok/s per GPU | measured | error | predicted peak GiB | allocated | reserved | error |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
        *rows,
    ]
    if measured:
        fastest = max(measured.values())
        first = measured.get(fits[0].layout.name)
        verdict = "not run" if first is None else f"{first / fastest:.2f}x of the fastest measured"
        lines += ["", f"The planner's first pick ({fits[0].layout.name}): {verdict} (target >= 0.95x)."]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
