"""Run the GPU benchmarks and GPU tests of one area, or all of them, with one command.

    python3 -m benchmarks.run --suite kernels                 # one suite
    python3 -m benchmarks.run --suite all --out /tmp/bench    # everything that fits this machine's GPUs
    python3 -m benchmarks.run --suite kernels training --check  # the regression guard of both tables
    python3 -m benchmarks.run --suite all --dry-run           # print the commands only

Each step is a benchmark script (or pytest) in its own process, with ``PYTHONPATH`` pointing at every
package's ``src`` folder of this checkout (no install needed: the machine's own python with torch and
triton runs it), ``NCCL_NVLS_ENABLE=0`` and unbuffered output. A step that needs more GPUs than
``torch.cuda.device_count()`` is skipped and says so. Each step's output goes to ``<out>/<step>.log``;
the markdown tables it printed (and the results file it wrote, where it writes one) are collected into
``<out>/summary.md``, which ends with one line per step: its exit status and wall time. The exit status
is non-zero when a step failed (with ``--check``: when a row is more than 5% slower than its table).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


@dataclass(frozen=True)
class Step:
    """One command of a suite.

    Attributes:
        name: The step's log name.
        argv: The arguments of python, run in the repository root (``-m benchmarks.<area>.<script>``);
            ``torchrun`` means ``python -m torch.distributed.run``.
        gpus: GPUs it needs.
        writes: The results file it writes (collected into the summary), if any.
        check: The command has a ``--check`` mode (the regression guard).
    """

    name: str
    argv: tuple[str, ...]
    gpus: int = 1
    writes: str | None = None
    check: bool = False


def _torchrun(n: int, module: str, *args: str) -> tuple[str, ...]:
    return ("torchrun", "--standalone", f"--nproc-per-node={n}", "-m", module, *args)


SUITES: dict[str, tuple[Step, ...]] = {
    "kernels": (
        Step("kernels", ("-m", "benchmarks.kernels.run_all", "--md", "benchmarks/results/kernels.md"),
             writes="kernels.md", check=True),
    ),
    "training": (
        Step("throughput", ("-m", "benchmarks.training.throughput"), writes="training.md", check=True),
        Step("scaling", ("-m", "benchmarks.training.scaling", "--gpus", "2", "4", "--concurrent", "--profile"), gpus=4,
             writes="scaling.md"),
        Step("nccl_bandwidth", _torchrun(2, "benchmarks.comms.nccl_bandwidth"), gpus=2),
    ),
    "moe": (
        Step("moe_layer", ("-m", "benchmarks.moe.moe_layer", "--markdown", "benchmarks/results/moe_layer.md"),
             writes="moe_layer.md"),
        Step("ep_all_to_all", _torchrun(2, "benchmarks.moe.ep_all_to_all", "--markdown",
             "benchmarks/results/moe_ep_all_to_all.md"), gpus=2, writes="moe_ep_all_to_all.md"),
        Step("ep_overlap", _torchrun(2, "benchmarks.moe.ep_overlap", "--compile", "--chunks", "2", "4"), gpus=2),
    ),
    "context": (
        Step("attention_kernels", ("-m", "benchmarks.context.attention_kernels")),
        Step("long_context", _torchrun(2, "benchmarks.context.long_context", "--search", "none"), gpus=2),
        Step("long_context_compiled",
             _torchrun(2, "benchmarks.context.long_context", "--search", "none", "--compile", "--flex-row"),
             gpus=2),
        Step("mla_context", _torchrun(2, "benchmarks.context.mla_context", "--markdown",
             "benchmarks/results/mla_context.md"), gpus=2, writes="mla_context.md"),
    ),
    "checkpoint": (
        Step("async_save", ("-m", "benchmarks.checkpoint.async_save", "--params-b", "1.0", "--saves", "3",
             "--modes", "off,process")),
    ),
    "model_state": (
        Step("load_throughput", ("-m", "benchmarks.model_state.load_throughput", "--size-gb", "8", "--device",
             "cuda", "--repeats", "2")),
    ),
    "pipelining": (
        Step("schedules", _torchrun(2, "benchmarks.pipelining.schedules", "--batch", "32", "--seq", "2048",
             "--microbatches", "8"), gpus=2),
        Step("layouts", ("-m", "benchmarks.training.layouts", "--gpus", "4", "--steps", "10"), gpus=4),
        *(Step(f"layouts_{family}", ("-m", "benchmarks.training.layouts", "--gpus", "2", "--steps", "10", "--family",
               family, "--dir", f"/tmp/plait_layouts_{family}"), gpus=2)
          for family in ("llama", "gpt_oss", "deepseek_v3")),
    ),
    "gpu-tests": (
        Step("gpu_tests", ("-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", "tests")),
        Step("multigpu_tests", ("-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "multigpu", "tests"),
             gpus=2),
    ),
}  # fmt: skip


def environment() -> dict[str, str]:
    """The environment of every step: this checkout's packages importable, NCCL multicast off."""
    env = dict(os.environ)
    src = [str(p) for p in sorted((ROOT / "packages").glob("*/src"))]
    env["PYTHONPATH"] = os.pathsep.join([*src, *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def command(step: Step, check: bool) -> list[str]:
    """The step's full command line (with ``--check`` in place of writing its table when asked)."""
    argv = list(step.argv)
    if argv[0] == "torchrun":
        argv = ["-m", "torch.distributed.run", *argv[1:]]
    if check and step.check:
        argv = [a for a in argv if a not in ("--md", "benchmarks/results/kernels.md")] + ["--check"]
    return [sys.executable, *argv]


def steps_of(suites: list[str]) -> list[Step]:
    """The steps of ``suites`` in order (``all``: every suite), each once."""
    names = list(SUITES) if "all" in suites else suites
    out: list[Step] = []
    for name in names:
        out += [s for s in SUITES[name] if s not in out]
    return out


def tables(text: str) -> str:
    """The markdown table lines of a step's output (``|`` rows) and the verdict lines around them."""
    keep = [ln for ln in text.splitlines() if ln.startswith("|") or ": MET" in ln or ": MISSED" in ln]
    return "\n".join(keep)


def gpu_count() -> int:
    """CUDA devices of this machine (0 without torch or CUDA)."""
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", nargs="+", required=True, choices=[*SUITES, "all"], help="suites to run")
    ap.add_argument("--out", type=Path, default=Path("/tmp/plait_benchmarks"), help="logs and summary.md")
    ap.add_argument(
        "--check", action="store_true", help="kernels and training: compare with results/ instead"
    )
    ap.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per step")
    args = ap.parse_args()
    steps = [s for s in steps_of(args.suite) if s.check or not args.check]
    if args.dry_run:
        for s in steps:
            print(f"{s.name} ({s.gpus} GPU{'s' if s.gpus > 1 else ''}): {' '.join(command(s, args.check))}")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    gpus, env, failed = gpu_count(), environment(), 0
    summary = [f"# Benchmark run, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {gpus} GPUs\n"]
    verdicts = []
    for s in steps:
        if s.gpus > gpus:
            verdicts.append(f"- {s.name}: skipped, needs {s.gpus} GPUs ({gpus} present)")
            continue
        cmd = command(s, args.check)
        print(f"=== {s.name}: {' '.join(cmd)}", flush=True)
        t0 = time.time()
        log = args.out / f"{s.name}.log"
        try:
            proc = subprocess.run(
                cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout
            )
            rc, text = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as e:
            rc, text = 124, f"{e.stdout or ''}{e.stderr or ''}\ntimed out after {args.timeout:.0f} s"
        log.write_text(text if isinstance(text, str) else text.decode(errors="replace"))
        failed += rc != 0
        verdicts.append(f"- {s.name}: rc {rc}, {time.time() - t0:.0f} s, log {log}")
        print(f"=== {s.name}: rc {rc}", flush=True)
        written = RESULTS / s.writes if s.writes and not (args.check and s.check) else None
        body = written.read_text() if written is not None and written.exists() else tables(log.read_text())
        summary.append(f"## {s.name}\n\n`{' '.join(cmd)}`\n\n{body}\n")
        if rc != 0:
            summary.append("```\n" + "\n".join(log.read_text().splitlines()[-20:]) + "\n```\n")
    summary.append("## Steps\n\n" + "\n".join(verdicts) + "\n")
    (args.out / "summary.md").write_text("\n".join(summary))
    print("\n".join(summary))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
