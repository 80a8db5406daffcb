"""Per-GPU throughput of the main job's GPU model on 1, 2, 4 and 8 GPUs: FSDP, EP and PP, with MFU.

    python3 benchmarks/training/scaling.py                          # 1 GPU + 2, 4, 8 (rows above the GPU count skipped)
    python3 benchmarks/training/scaling.py --gpus 4 --out $OUT/scaling.md
    python3 benchmarks/training/scaling.py --smoke --gpus 2         # CPU processes over gloo, tiny model

The model is ``examples/qwen3_moe/configs/gpu1.toml``'s (compiled, bf16 parameters, StochasticAdamW), batch
4 x 2048 tokens per GPU (equal tokens per GPU in every row). Rows are ``benchmarks/training/throughput.py``'s
Trainer rows, each in its own torchrun: the 1-GPU row, then for every ``--gpus`` count n
FSDP n (``--parallel.reshard_after_forward=false``), EP=n x FSDP=n, and PP n (1F1B, 2n microbatches).
A row needing more GPUs than ``torch.cuda.device_count()`` is skipped and the table says so.
Writes a markdown table (tok/s per GPU, MFU against the bf16 matmul rate measured in the same run, rank 0's peak
GiB, per-GPU ratio to the 1-GPU row) to ``--out`` (default ``benchmarks/results/scaling.md``). ``--profile``
prints each row's kernel-time table (rank 0), to see why a layout falls short.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import throughput  # benchmarks/training/throughput.py

RESULTS = throughput.ROOT / "benchmarks" / "results" / "scaling.md"
BASELINE = "moe.plait_trainer_compiled"
LABELS = {"fsdp": "FSDP{n}", "ep": "EP{n} x FSDP{n}", "pp": "PP{n} 1F1B ({m} microbatches)"}
TARGET = ("moe.plait_trainer_fsdp4", 0.9)  # FSDP4 per-GPU tok/s >= 0.9x the 1-GPU figure


def label(row: str) -> str:
    """The table's name of a row."""
    if row == BASELINE:
        return "1 GPU"
    m = re.fullmatch(r"moe\.plait_trainer_(fsdp|ep|pp)(\d+)", row)
    assert m is not None, row
    return LABELS[m[1]].format(n=int(m[2]), m=2 * int(m[2]))


def table(results: list[dict[str, Any]], peak_tflops: float, fpt: float) -> str:
    """Markdown rows: tok/s per GPU, MFU, peak memory and the per-GPU ratio to the 1-GPU row."""
    base = next((r["tok_s_per_gpu"] for r in results if r["row"] == BASELINE and "skipped" not in r), None)
    lines = [
        "| layout | GPUs | tok/s per GPU | MFU | peak GiB (rank 0) | per GPU vs 1 GPU |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        n = throughput.trainer_layout(r["row"], batch=4)[0]  # the count does not depend on the batch
        if "skipped" in r:
            lines.append(f"| {label(r['row'])} | {n} | {r['skipped']} | | | |")
            continue
        tps = r["tok_s_per_gpu"]
        mfu = fpt * tps / (peak_tflops * 1e12)
        ratio = f"{tps / base:.2f}x" if base else ""
        lines.append(
            f"| {label(r['row'])} | {n} | {tps / 1e3:.1f}k | {mfu:.1%} | {r['peak_gib']:.1f} | {ratio} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int, nargs="+", default=[2, 4, 8], help="GPU counts next to the 1-GPU row")
    ap.add_argument("--layouts", nargs="+", choices=list(LABELS), default=list(LABELS))
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--row-timeout", type=float, default=240)
    ap.add_argument("--smoke", action="store_true", help="CPU processes over gloo, tiny model, 2 steps")
    ap.add_argument("--profile", action="store_true", help="print a kernel-time table of 3 steps per row")
    ap.add_argument("--out", type=Path, help=f"markdown file (default {RESULTS}; none with --smoke)")
    args = ap.parse_args()
    if any(n < 2 for n in args.gpus):
        ap.error(f"--gpus: counts of 2 or more (the 1-GPU row always runs), got {args.gpus}")
    rows = [BASELINE] + [f"moe.plait_trainer_{kind}{n}" for n in args.gpus for kind in args.layouts]
    targv = ["--model", "gpu1", "--steps", str(args.steps), "--warmup", str(args.warmup)]
    targv += ["--row-timeout", str(args.row_timeout), "--no-write"]
    targv += ["--smoke"] * args.smoke + ["--profile"] * args.profile
    targs = throughput.parse_args(targv)
    results, peak, fpt, env = throughput.measure(targs, rows)
    body = table(results, peak, fpt)
    by = {r["row"]: r for r in results}
    row, want = TARGET
    note = ""
    if row in by and "skipped" not in by[row] and "skipped" not in by[BASELINE]:
        got = by[row]["tok_s_per_gpu"] / by[BASELINE]["tok_s_per_gpu"]
        note = f"\n\nFSDP4 per GPU vs 1 GPU: {got:.2f}x (target >= {want}x: {'met' if got >= want else 'missed'})."
    m = targs.model
    text = (
        "# Scaling: per-GPU throughput of the main job's GPU model\n\n"
        f"**device:** {env}\n\n**command:** `python3 benchmarks/training/scaling.py {' '.join(sys.argv[1:])}`\n\n"
        f"bf16 matmul rate measured in the same run: {peak:.0f} TFLOP/s (MFU denominator); {fpt / 1e9:.2f} GFLOP/token. Model: "
        f"{m['num_hidden_layers']} layers, hidden {m['hidden_size']}, {m['num_experts']} experts top-"
        f"{m['num_experts_per_tok']}, vocab {m['vocab_size']}; batch {targs.batch} x {targs.seq} per GPU, "
        f"compiled; {targs.warmup} warm-up steps, {targs.steps} timed.\n\n{body}{note}\n"
    )
    print(text)
    out = args.out or (None if args.smoke else RESULTS)
    if out is not None:
        out.write_text(text)


if __name__ == "__main__":
    main()
