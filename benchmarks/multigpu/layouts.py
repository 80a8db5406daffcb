"""Loss curves of the Qwen3-MoE main job across parallel layouts on NCCL, from one seed checkpoint.

    python benchmarks/multigpu/layouts.py --gpus 4 --steps 20 --out results.md

Writes a seed checkpoint, runs the 1-GPU reference and every layout that fits ``--gpus`` with
torchrun, and compares each layout's per-step loss with the reference (max relative difference).
Also saves a checkpoint on all GPUs and resumes it on half of them (the curve must continue).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "qwen3_moe" / "pretrain.py"

# name, processes, overrides
LAYOUTS: list[tuple[str, int, list[str]]] = [
    ("FSDP2", 2, ["--mesh.data_shard=2"]),
    ("EP2 x FSDP2", 2, ["--mesh.data_shard=2", "--mesh.expert=2"]),
    ("PP2 1F1B", 2, ["--mesh.pipeline=2", "--pipeline.kind=1f1b"]),
    ("PP2 ZBV", 2, ["--mesh.pipeline=2", "--pipeline.kind=zbv"]),
    ("PP2 DualPipeV", 2, ["--mesh.pipeline=2", "--pipeline.kind=dualpipev"]),
    ("FSDP4", 4, ["--mesh.data_shard=4"]),
    ("HSDP 2x2", 4, ["--mesh.data_replicate=2", "--mesh.data_shard=2"]),
    ("DP2 x TP2", 4, ["--mesh.data_replicate=2", "--mesh.tensor=2"]),
    ("PP2 x DP2", 4, ["--mesh.pipeline=2", "--mesh.data_shard=2", "--pipeline.kind=1f1b"]),
    ("PP2 x EP2", 4, ["--mesh.pipeline=2", "--mesh.data_shard=2", "--mesh.expert=2", "--pipeline.kind=1f1b"]),
    ("PP4 1F1B", 4, ["--mesh.pipeline=4", "--pipeline.kind=1f1b"]),
    (
        "PP4 Interleaved 1F1B",
        4,
        ["--mesh.pipeline=4", "--pipeline.kind=interleaved_1f1b", "--pipeline.stages_per_rank=2"],
    ),
    ("PP4 ZB1P", 4, ["--mesh.pipeline=4", "--pipeline.kind=zb1p", "--pipeline.stages_per_rank=2"]),
    ("PP4 ZBV", 4, ["--mesh.pipeline=4", "--pipeline.kind=zbv"]),
    ("PP4 DualPipeV", 4, ["--mesh.pipeline=4", "--pipeline.kind=dualpipev"]),
    (
        "PP2 x FSDP2 x EP2",
        8,
        ["--mesh.pipeline=2", "--mesh.data_shard=4", "--mesh.expert=2", "--pipeline.kind=1f1b"],
    ),
]

BASE = [
    "--logging.progress_bar=false",
    "--logging.interval=1",
    "--no-export",
    "--batching.global_batch_size=16",
    "--batching.microbatch_size=2",
    "--batching.seq_len=256",
    "--data.max_files=200",
    "--model.num_hidden_layers=8",
    "--run.device=cuda",
]
if "--cpu-smoke" in sys.argv:  # gloo on CPU processes: checks the driver itself, not the numbers
    BASE[BASE.index("--run.device=cuda")] = "--run.device=cpu"
    BASE[BASE.index("--batching.seq_len=256")] = "--batching.seq_len=32"


def launch(nproc: int, run_dir: Path, args: list[str], timeout: int) -> tuple[int, float, str]:
    """torchrun the main job; on timeout every process dumps its Python stacks (faulthandler) and dies."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(SCRIPT),
    ]
    t0 = time.perf_counter()
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
    p = subprocess.Popen(
        [*cmd, *BASE, f"--run-dir={run_dir}", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        out, _ = p.communicate(timeout=timeout)
        rc = p.returncode
    except subprocess.TimeoutExpired:
        # torchrun starts its workers in sessions of their own: signal every process of the tree
        import psutil

        tree = [psutil.Process(p.pid), *psutil.Process(p.pid).children(recursive=True)]
        for sig in (signal.SIGABRT, signal.SIGKILL):  # ABRT: faulthandler dumps the Python stacks
            for proc in tree:
                with contextlib.suppress(psutil.Error):
                    proc.send_signal(sig)
            time.sleep(5)
        out, _ = p.communicate(timeout=30)
        rc = 124
    return rc, time.perf_counter() - t0, out[-6000:]


def losses(run_dir: Path) -> dict[int, float]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return {}
    return {r["step"]: r["loss"] for r in map(json.loads, path.read_text().splitlines())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--dir", default="/tmp/plait_layouts")
    ap.add_argument("--out", default=None)
    ap.add_argument("--timeout", type=int, default=240)
    ap.add_argument("--cpu-smoke", action="store_true")
    ap.add_argument("--only", default="", help="comma-separated layout names")
    ap.add_argument("--skip-resume", action="store_true", help="skip the save-on-all, resume-on-half run")
    args = ap.parse_args()
    work = Path(args.dir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    seed = work / "seed"
    steps = [f"--steps={args.steps}", f"--init-from={seed}", "--checkpoint.enabled=false"]
    subprocess.run([sys.executable, str(SCRIPT), *BASE, f"--write-seed-checkpoint={seed}"], check=True)
    rows = []
    rc, secs, log = launch(1, work / "ref", steps, args.timeout)
    ref = losses(work / "ref")
    rows.append(("1 GPU (reference)", 1, rc, secs, 0.0, ref.get(1), ref.get(args.steps)))
    if rc:
        print(log)
    only = set(args.only.split(",")) if args.only else None
    for name, nproc, extra in LAYOUTS:
        if nproc > args.gpus or (only and name not in only):
            continue
        d = work / name.replace(" ", "_")
        rc, secs, log = launch(nproc, d, steps + extra, args.timeout)
        got = losses(d)
        diff = max((abs(got[s] - ref[s]) / abs(ref[s]) for s in ref if s in got), default=float("nan"))
        if rc or len(got) != len(ref):
            print(f"--- {name} failed (rc={rc}) ---\n{log}", flush=True)
            diff = float("nan")
        rows.append((name, nproc, rc, secs, diff, got.get(1), got.get(args.steps)))
        print(rows[-1], flush=True)

    # Async checkpoint on all GPUs, resumed on half: the resumed curve must continue the reference.
    if not args.skip_resume:
        rows.append(resume_row(args, work, seed, ref))
    write_table(args, rows)


def resume_row(args: argparse.Namespace, work: Path, seed: Path, ref: dict[int, float]) -> tuple:
    ck = work / "ckpt"
    half = max(1, args.gpus // 2)
    ck_args = [
        f"--steps={args.steps}",
        f"--init-from={seed}",
        "--checkpoint.enabled=true",
        f"--checkpoint.interval={args.steps // 2}",
        "--checkpoint.keep_last=4",
    ]
    rc1, _, log1 = launch(args.gpus, ck, [*ck_args, f"--mesh.data_shard={args.gpus}"], args.timeout)
    shutil.rmtree(ck / "checkpoints" / f"step_{args.steps:08d}", ignore_errors=True)
    (ck / "metrics.jsonl").unlink(missing_ok=True)
    rc2, _, log2 = launch(half, ck, [*ck_args, f"--mesh.data_shard={half}"], args.timeout)
    got = losses(ck)
    resumed = {s: v for s, v in got.items() if s > args.steps // 2}
    diff = max((abs(v - ref[s]) / abs(ref[s]) for s, v in resumed.items()), default=float("nan"))
    if rc1 or rc2 or not resumed:
        print(f"--- checkpoint resume failed rc={rc1},{rc2} ---\n{log1}\n{log2}")
        diff = float("nan")
    return (
        f"save FSDP{args.gpus} @ {args.steps // 2}, resume FSDP{half}",
        args.gpus,
        rc1 or rc2,
        0.0,
        diff,
        None,
        got.get(args.steps),
    )


def write_table(args: argparse.Namespace, rows: list[tuple]) -> None:
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (gloo)"
    lines = [
        f"Device: {device} x {args.gpus}, torch {torch.__version__}, "
        f"NCCL (NCCL_NVLS_ENABLE={os.environ.get('NCCL_NVLS_ENABLE')}); {args.steps} steps from one seed checkpoint.",
        "",
        "| layout | GPUs | rc | wall s | max rel. loss diff vs 1 GPU | loss step 1 | loss last step |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, n, rc, secs, diff, first, last in rows:
        lines.append(f"| {name} | {n} | {rc} | {secs:.0f} | {diff:.2e} | {first} | {last} |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        Path(args.out).write_text(table + "\n")


if __name__ == "__main__":
    main()
