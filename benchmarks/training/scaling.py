"""Per-GPU throughput at 1, 2 and 4 GPUs (8 where present): a dense and a MoE workload, torchtitan beside.

    python3 -m benchmarks.training.scaling                          # 1 GPU + 2 and 4; writes results/scaling.md
    python3 -m benchmarks.training.scaling --gpus 2 4 8 --profile   # + a timeline summary per row
    python3 -m benchmarks.training.scaling --smoke --gpus 2         # CPU processes over gloo, tiny models

Workloads (``workloads.py``), equal tokens per GPU in every row:
  dense  Qwen3-1.7B shapes, 2 x 4096 per GPU, every block compiled. plait: the model from
         ``CausalLMProvider`` sharded by ``provider.parallelize`` (FSDP2 over ``data_shard`` = n, ``DENSE``'s
         ``ParallelConfig``), StochasticAdamW with bf16 moments. torchtitan: its Qwen3 model,
         blocks compiled, then torchtitan 0.2.2's own ``apply_fsdp`` (embeddings, each block, norm + output,
         the root; bf16 gradient reduction like plait's), fused torch AdamW.
  moe    the 1.14B Qwen3-MoE, 4 x 2048 per GPU: the main job's Trainer (``plait train``
         with ``gpu1.toml``'s settings: the compiled layers replayed as CUDA graphs), FSDP over n and EP = n x
         FSDP = n (``all_gather`` dispatch).

Each row is one process per GPU (torchrun), ``--windows`` timed windows of ``--steps`` steps after
``--warmup``: the table shows the median window's tok/s per GPU and the spread over the windows ((max - min) /
median); with ``--runs N`` every row runs N times in new processes (all rows once, then again: a slow stretch
of the machine meets every row alike) and the table shows the median of the runs' tok/s and the spread over
the runs, which also holds what changes from one process to the next. Then peak GiB (rank 0) and the per-GPU
ratio to the 1-GPU row of its workload; dense rows also show the ratio to torchtitan at the same GPU count;
MoE rows the routing's balance as expert parallelism meets it (the busiest of 2 / 4 equal ranges of experts
over their mean, from rank 0's tokens of the timed steps: 1.00 is balanced, and an EP step waits for its
busiest rank). A row needing more GPUs than present is skipped. ``--profile`` adds, per row, a timeline of 3
more steps (rank 0, ``throughput.timeline``): communication and its exposed part per step, the host's time to
issue a step, the fraction of the step the GPU is idle. ``--dense-variants`` / ``--moe-variants`` add rows of
other settings (A/B in the same run; the MoE variants at 1 GPU too, e.g.
``--moe-variants '{"no_graphs": "--parallel.cuda_graphs=false"}'``; a variant's "vs 1 GPU" is against the
default 1-GPU row).
Writes ``--out`` (default ``benchmarks/results/scaling.md``; none with ``--smoke``).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from benchmarks.training import throughput

RESULTS = throughput.ROOT / "benchmarks" / "results" / "scaling.md"
# The ParallelConfig of plait's dense rows over several GPUs (the table's "default" variant): parameters stay
# gathered from forward to backward (one all-gather per unit and step instead of two), for the unsharded
# layers' memory (still below torchtitan's peak); two layers per FSDP2 unit and the embedding's rows kept
# sharded (its 151k x 2048 table never gathered), +1.9% on 2 x H200 over one layer per unit and a gathered
# table (results/scaling.md). The all-gathers go into NCCL symmetric memory by default
# (ParallelConfig.fsdp_symmetric_memory; +0.7-1.3% on 2 x H200).
DENSE = {"reshard_after_forward": False, "fsdp_layers_per_unit": 2, "shard_embedding_rows": True}
# the row at n GPUs -> the row at 1 GPU
ROWS = {
    "dense.plait_step_fsdp{n}": "dense.plait_step_compiled",
    "dense.torchtitan_fsdp{n}": "dense.torchtitan_compiled",
    "moe.plait_trainer_fsdp{n}": "moe.plait_trainer_compiled",
    "moe.plait_trainer_ep{n}": "moe.plait_trainer_compiled",
}
# (what, row at n GPUs, baseline: "1" = its 1-GPU row / "titan" = torchtitan at n, GPU counts, at least)
TARGETS = (
    ("dense FSDP per GPU vs 1 GPU", "dense.plait_step_fsdp{n}", "1", (2, 4), 0.95),
    ("dense FSDP vs torchtitan FSDP", "dense.plait_step_fsdp{n}", "titan", (2, 4), 1.05),
    ("MoE FSDP per GPU vs 1 GPU", "moe.plait_trainer_fsdp{n}", "1", (2, 4), 0.9),
    ("MoE EP x FSDP per GPU vs 1 GPU", "moe.plait_trainer_ep{n}", "1", (2,), 0.9),
    ("MoE EP x FSDP per GPU vs 1 GPU", "moe.plait_trainer_ep{n}", "1", (4,), 0.85),
)


def rows_for(counts: list[int]) -> list[tuple[str, int]]:
    """(row, GPUs) of every row: the 1-GPU rows, then each count's."""
    return [(r, 1) for r in dict.fromkeys(ROWS.values())] + [(m.format(n=n), n) for n in counts for m in ROWS]


def _key(r: dict[str, Any]) -> tuple[str, str]:
    return r["row"], r.get("variant", "")


def baseline(row: str, n: int, against: str) -> str | None:
    """The row ``row`` (at ``n`` GPUs) is compared with: its 1-GPU row (``against="1"``) or, for plait's
    dense rows, torchtitan's at the same GPU count (``"titan"``)."""
    if against == "titan":
        if not row.startswith("dense.plait"):
            return None
        return "dense.torchtitan_compiled" if n == 1 else f"dense.torchtitan_fsdp{n}"
    return next(s for m, s in ROWS.items() if row in (s, m.format(n=n)))


def table(results: list[dict[str, Any]], profile: bool) -> str:
    """Markdown: one line per row and variant."""
    by = {_key(r): r for r in results}
    head = (
        "| workload, layout | GPUs | variant | tok/s per GPU | spread | peak GiB | per GPU vs 1 GPU | vs torchtitan "
        "| EP busiest rank's expert load, 2 / 4 |"
    )
    sep = "|---|---:|---|---:|---:|---:|---:|---:|---:|"
    if profile:
        head += " comm ms/step (exposed) | host ms/step | GPU idle |"
        sep += "---:|---:|---:|"
    lines = [head, sep]
    for r in results:
        n = throughput.trainer_layout(r["row"], 4)[0]
        name = r["row"]
        if "skipped" in r:
            lines.append(
                f"| {name} | {n} | {r.get('variant', '')} | {r['skipped']} |" + " |" * (8 if profile else 5)
            )
            continue
        tps = r["tok_s_per_gpu"]
        base, titan = (by.get((baseline(name, n, b), ""), {}).get("tok_s_per_gpu") for b in ("1", "titan"))
        load = " / ".join(f"{r[k]:.2f}" for k in ("expert_load_ep2", "expert_load_ep4") if k in r)
        line = (
            f"| {name} | {n} | {r.get('variant', '') or 'default'} | {tps / 1e3:.1f}k | {r['spread']:.1%} | "
            f"{r['peak_gib']:.1f} | {f'{tps / base:.2f}x' if base else ''} | {f'{tps / titan:.2f}x' if titan else ''} |"
            f" {load} |"
        )
        if profile:
            line += (
                f" {r.get('comm_ms', float('nan')):.1f} ({r.get('exposed_comm_ms', float('nan')):.1f}) |"
                f" {r.get('host_ms', float('nan')):.1f} | {r.get('gpu_idle', float('nan')):.0%} |"
            )
        lines.append(line)
    return "\n".join(lines)


def verdicts(results: list[dict[str, Any]]) -> list[str]:
    """One line per target measured in this run (default settings only)."""
    by = {_key(r): r for r in results if "skipped" not in r}
    out = []
    for what, pattern, base, counts, want in TARGETS:
        for n in counts:
            row = by.get((pattern.format(n=n), ""))
            ref = by.get((baseline(pattern.format(n=n), n, base), ""))
            if row is None or ref is None:
                continue
            ratio = row["tok_s_per_gpu"] / ref["tok_s_per_gpu"]
            out.append(
                f"{what}, {n} GPUs: {ratio:.2f}x (target >= {want}x): {'MET' if ratio >= want else 'MISSED'}"
            )
    return out


def _run(
    row: str, targs: argparse.Namespace, variants: str, devices: list[int] | None, trainer_args: str = ""
) -> list[dict[str, Any]]:
    """One row in its own process(es) on ``devices`` with its variants and Trainer flags."""
    t = copy.copy(targs)
    t.variants, t.trainer_args = variants, trainer_args
    return throughput.spawn_rows(row, t, devices)


def _measure(
    rows: list[tuple[str, int]], targs: argparse.Namespace, args: argparse.Namespace, dense_variants: str
) -> list[dict[str, Any]]:
    """One run of every row (its variants included), in the table's order."""
    results: list[dict[str, Any]] = []
    gpus = max(1, torch.cuda.device_count())
    for n in dict.fromkeys(n for _, n in rows):
        # The dense rows of one GPU count side by side on disjoint GPUs (--concurrent): they are bound by
        # the device, not the host. The MoE rows (host-bound) run alone.
        dense = [r for r, m in rows if m == n and r.startswith("dense.")]
        width = gpus // n if args.concurrent and not args.smoke else 1
        for i in range(0, len(dense), width):
            jobs = dense[i : i + width]
            with ThreadPoolExecutor(len(jobs)) as pool:
                futures = [
                    pool.submit(
                        _run, r, targs, dense_variants if n > 1 else '{"": {}}', list(range(k * n, k * n + n))
                    )
                    for k, r in enumerate(jobs)
                ]
                results += [res for f in futures for res in f.result()]
        for row in [r for r, m in rows if m == n and r.startswith("moe.")]:
            results += throughput.spawn_rows(row, targs)
            for name, flags in json.loads(args.moe_variants).items():
                results += [{**r, "variant": name} for r in _run(row, targs, '{"": {}}', None, flags)]
    return results


def median_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One row's runs as one result: the median run's tok/s (the upper one of an even count), the spread over
    the runs ((max - min) / median), the highest peak memory, the mean of the other figures; a row skipped in
    any run is skipped."""
    if len({(r["row"], r.get("variant", "")) for r in runs}) != 1:
        raise ValueError(f"median_of: runs of different rows: {[(r['row'], r.get('variant')) for r in runs]}")
    if skipped := [r for r in runs if "skipped" in r]:
        return skipped[0]
    tps = sorted(r["tok_s_per_gpu"] for r in runs)
    mid = tps[len(tps) // 2]
    out = {k: sum(r[k] for r in runs) / len(runs) if isinstance(v, float) else v for k, v in runs[0].items()}
    out.update(tok_s_per_gpu=mid, spread=(tps[-1] - tps[0]) / mid, peak_gib=max(r["peak_gib"] for r in runs))
    return {**out, "runs": len(runs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int, nargs="+", default=[2, 4], help="GPU counts next to the 1-GPU rows")
    ap.add_argument("--workloads", nargs="+", choices=("dense", "moe"), default=["dense", "moe"])
    ap.add_argument("--steps", type=int, default=10, help="steps per timed window")
    ap.add_argument("--windows", type=int, default=3)
    ap.add_argument("--runs", type=int, default=1, help="runs of every row, each in new processes")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--row-timeout", type=float, default=300)
    ap.add_argument("--smoke", action="store_true", help="CPU processes over gloo, tiny models, 2 steps")
    ap.add_argument("--profile", action="store_true", help="a timeline summary of 3 more steps per row")
    ap.add_argument("--titan", action=argparse.BooleanOptionalAction, default=True, help="torchtitan's rows")
    ap.add_argument(
        "--dense-variants", default="{}", help="JSON {name: ParallelConfig overrides}: more plait dense rows"
    )
    ap.add_argument(
        "--moe-variants",
        default="{}",
        help="JSON {name: main-job flags}: more MoE rows, at 1 GPU too (each compared with the default 1-GPU row)",
    )
    ap.add_argument(
        "--concurrent",
        action="store_true",
        help="run the dense rows of one GPU count side by side on disjoint GPUs (4 GPUs: two 2-GPU rows at once)",
    )
    ap.add_argument("--log-dir", type=Path, help="write each row's full output (profile tables) here")
    ap.add_argument("--out", type=Path, help=f"markdown file (default {RESULTS}; none with --smoke)")
    args = ap.parse_args()
    if any(n < 2 for n in args.gpus):
        ap.error(f"--gpus: counts of 2 or more (the 1-GPU rows always run), got {args.gpus}")
    if args.runs < 1:
        ap.error(f"--runs: 1 or more, got {args.runs}")
    rows = [r for r in rows_for(args.gpus) if r[0].split(".")[0] in args.workloads]
    if not args.titan:
        rows = [r for r in rows if "torchtitan" not in r[0]]
    argv = ["--steps", str(args.steps), "--warmup", str(args.warmup), "--windows", str(args.windows)]
    argv += ["--row-timeout", str(args.row_timeout), "--no-write"]
    argv += ["--smoke"] * args.smoke + ["--profile"] * args.profile
    argv += ["--log-dir", str(args.log_dir)] if args.log_dir else []
    targs = throughput.parse_args(argv)
    peak, _, env = throughput.measure(targs, [])[1:]
    env = f"{torch.cuda.device_count()} x {env}" if torch.cuda.is_available() else env
    dense_variants = json.dumps({"": DENSE, **json.loads(args.dense_variants)})
    runs = [_measure(rows, targs, args, dense_variants) for _ in range(args.runs)]
    results = runs[0] if args.runs == 1 else [median_of(list(same)) for same in zip(*runs, strict=True)]
    body = table(results, args.profile)
    lines = verdicts(results)
    text = (
        "# Scaling: per-GPU throughput at 1, 2 and 4 GPUs\n\n"
        f"**device:** {env}; bf16 matmul {peak:.0f} TFLOP/s\n\n"
        f"**command:** `python3 -m benchmarks.training.scaling {' '.join(sys.argv[1:])}`\n\n"
        f"{body}\n\n" + "\n".join(f"- {v}" for v in lines) + "\n"
    )
    print(text, flush=True)
    out = args.out or (None if args.smoke else RESULTS)
    if out is not None:
        out.write_text(text)


if __name__ == "__main__":
    main()
