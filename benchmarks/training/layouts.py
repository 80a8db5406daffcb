"""Loss curves of the main job across parallel layouts on NCCL, from one seed checkpoint.

    python -m benchmarks.training.layouts --gpus 4 --steps 20 --out results.md
    python -m benchmarks.training.layouts --gpus 4 --only "FSDP4,CP4,resume,lora"
    python -m benchmarks.training.layouts --gpus 4 --cpu-smoke --steps 3 --only "CP4,EP4"   # gloo, CPU
    python -m benchmarks.training.layouts --gpus 2 --family llama    # another model family

Writes a seed checkpoint, runs the 1-GPU reference and every layout that fits ``--gpus`` with
torchrun, and compares each layout's per-step loss with the reference (max relative difference).
``--family`` picks the model: ``qwen3_moe`` (default: the Qwen3-MoE main job
``examples/qwen3_moe/pretrain.py`` at 8 layers, every layout below) or a family of
``examples/configs/<family>/cpu.toml`` run by ``examples/train.py`` on the GPU (``qwen3_next``:
``examples/configs/qwen3_5/moe_cpu.toml``), with the layouts that family is meant for (``FAMILY_LAYOUTS``;
``--only`` picks among all of them).
Two more parts, Qwen3-MoE only (``--only`` names them like layouts; both run when ``--only`` is not given):

- ``resume``: an async checkpoint saved halfway on all GPUs with FSDP x EP, resumed on half of them
  with other layouts (FSDP, and PP 1F1B when half >= 2): each resumed curve must continue the reference.
- ``lora``: LoRA fine-tuning (``examples/qwen3_moe/finetune_lora.py``) of the seed checkpoint on one GPU
  and with FSDP2 on two (same curve), and each exported adapter loaded by ``peft`` onto the
  transformers model gives plait's logits (an "adapter in peft" row: max abs. logit difference in the
  diff column; nan when the adapter left the logits unchanged).

``--cpu-smoke`` runs the same on CPU processes over gloo (checks the driver).
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
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "qwen3_moe"
SCRIPT = EXAMPLES / "pretrain.py"
FAMILY_SCRIPT = ROOT / "examples" / "train.py"

# name, processes, overrides
LAYOUTS: list[tuple[str, int, list[str]]] = [
    ("FSDP2", 2, ["--mesh.data_shard=2"]),
    ("EP2 x FSDP2", 2, ["--mesh.data_shard=2", "--mesh.expert=2"]),
    ("PP2 1F1B", 2, ["--mesh.pipeline=2", "--pipeline.kind=1f1b"]),
    ("PP2 ZBV", 2, ["--mesh.pipeline=2", "--pipeline.kind=zbv"]),
    ("PP2 DualPipeV", 2, ["--mesh.pipeline=2", "--pipeline.kind=dualpipev"]),
    ("CP2", 2, ["--mesh.context_shard=2"]),
    ("TP2", 2, ["--mesh.tensor=2"]),
    ("FSDP4", 4, ["--mesh.data_shard=4"]),
    ("HSDP 2x2", 4, ["--mesh.data_replicate=2", "--mesh.data_shard=2"]),
    ("DP2 x TP2", 4, ["--mesh.data_replicate=2", "--mesh.tensor=2"]),
    ("PP2 x DP2", 4, ["--mesh.pipeline=2", "--mesh.data_shard=2", "--pipeline.kind=1f1b"]),
    ("PP2 x EP2", 4, ["--mesh.pipeline=2", "--mesh.data_shard=2", "--mesh.expert=2", "--pipeline.kind=1f1b"]),
    ("EP4", 4, ["--mesh.data_shard=4", "--mesh.expert=4"]),
    ("CP2 x FSDP2", 4, ["--mesh.context_shard=2", "--mesh.data_shard=2"]),
    ("CP4", 4, ["--mesh.context_shard=4"]),
    ("PP4 1F1B", 4, ["--mesh.pipeline=4", "--pipeline.kind=1f1b"]),
    (
        "PP4 Interleaved 1F1B",
        4,
        ["--mesh.pipeline=4", "--pipeline.kind=interleaved_1f1b", "--pipeline.stages_per_rank=2"],
    ),
    ("PP4 ZB1P", 4, ["--mesh.pipeline=4", "--pipeline.kind=zb1p", "--pipeline.stages_per_rank=2"]),
    ("PP4 ZBV", 4, ["--mesh.pipeline=4", "--pipeline.kind=zbv"]),
    ("PP4 DualPipeV", 4, ["--mesh.pipeline=4", "--pipeline.kind=dualpipev"]),
    # "PP2 x FSDP2 x EP2" on 8 GPUs: experts are sharded inside the data ranks, so PP2 x FSDP4 x EP2
    (
        "PP2 x FSDP4 x EP2",
        8,
        ["--mesh.pipeline=2", "--mesh.data_shard=4", "--mesh.expert=2", "--pipeline.kind=1f1b"],
    ),
    ("FSDP8 x EP8", 8, ["--mesh.data_shard=8", "--mesh.expert=8"]),
    ("PP4 x DP2", 8, ["--mesh.pipeline=4", "--mesh.data_shard=2", "--pipeline.kind=1f1b"]),
]
PARTS = ("resume", "lora")  # selectable with --only next to the layout names
# --family: the layouts each family is checked in by default, and the [model] overrides every run of it
# takes (TP2 needs 2 KV heads, the Llama config has one; DeepSeek-V3's multi-token prediction needs one
# pipeline stage and no context parallelism)
FAMILY_LAYOUTS: dict[str, list[str]] = {
    "llama": ["FSDP2", "TP2", "PP2 ZBV", "PP2 DualPipeV", "CP2"],
    "gpt_oss": ["EP2 x FSDP2", "TP2", "PP2 ZBV", "CP2"],
    "deepseek_v3": ["EP2 x FSDP2", "PP2 ZBV", "CP2"],
    # Qwen3.5 (dense) and Qwen3-Next (MoE): gated DeltaNet layers refuse context parallelism
    "qwen3_5": ["FSDP2", "TP2", "PP2 1F1B", "PP2 ZBV"],
    "qwen3_next": ["EP2 x FSDP2", "TP2", "PP2 1F1B"],
}
FAMILY_MODEL: dict[str, list[str]] = {
    "llama": ["--model.num_key_value_heads=2"],
    "deepseek_v3": ["--model.mtp_loss_weight=none"],
    "qwen3_5": ["--model.num_key_value_heads=2"],
    "qwen3_next": ["--model.num_key_value_heads=2"],
}
# a family's config where it is not examples/configs/<family>/cpu.toml
FAMILY_CONFIG: dict[str, Path] = {"qwen3_next": ROOT / "examples" / "configs" / "qwen3_5" / "moe_cpu.toml"}

SMOKE = "--cpu-smoke" in sys.argv  # gloo on CPU processes: checks the driver itself, not the numbers
# Arguments of both the main job and the LoRA fine-tuning (sequence divisible by 2 x CP for CP4).
COMMON = [
    "--logging.progress_bar=false",
    "--logging.interval=1",
    f"--batching.seq_len={32 if SMOKE else 256}",
    f"--data.max_files={20 if SMOKE else 200}",
    f"--run.device={'cpu' if SMOKE else 'cuda'}",
]
BASE = [
    *COMMON,
    "--no-export",
    "--batching.global_batch_size=16",
    "--batching.microbatch_size=2",
    "--model.num_hidden_layers=8",  # 8 stages for PP4 with 2 stages per rank
]
LORA = EXAMPLES / "finetune_lora.py"
LORA_BASE = [*COMMON, "--batching.global_batch_size=8", "--batching.microbatch_size=2", "--optimizer.lr=0.01"]


def main_job(family: str) -> tuple[Path, list[str]]:
    """The script and the arguments of every run of ``family``'s main job."""
    if family == "qwen3_moe":
        return SCRIPT, BASE
    config = FAMILY_CONFIG.get(family, ROOT / "examples" / "configs" / family / "cpu.toml")
    family_base = [a for a in BASE if not a.startswith("--model.")]  # the family's own layer count
    return FAMILY_SCRIPT, ["--config", str(config), *family_base, *FAMILY_MODEL.get(family, [])]


def launch(
    nproc: int, run_dir: Path, args: list[str], timeout: int, script: Path = SCRIPT, base: list[str] = BASE
) -> tuple[int, float, str]:
    """torchrun ``script`` with ``base`` (the main job's: BASE) then ``args``; on timeout every process dumps
    its Python stacks and dies."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(script),
    ]
    t0 = time.perf_counter()
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
    if SMOKE:  # several CPU processes on few cores
        env["OMP_NUM_THREADS"] = "1"
    p = subprocess.Popen(
        [*cmd, *base, f"--run-dir={run_dir}", *args],
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
    return {r["step"]: r["loss"] for r in map(json.loads, path.read_text().splitlines()) if "loss" in r}


def max_rel_diff(got: dict[int, float], ref: dict[int, float]) -> float:
    return max((abs(got[s] - ref[s]) / abs(ref[s]) for s in ref if s in got), default=float("nan"))


class Results:
    """The table: each row is printed, and with ``--out`` the file is rewritten after every row (a run
    cut off by its time limit keeps the rows that finished)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rows: list[tuple[Any, ...]] = []  # name, GPUs, rc, wall s, diff, first loss, last loss

    def add(self, *row: Any) -> None:
        self.rows.append(row)
        print(row, flush=True)
        if self.args.out:
            Path(self.args.out).write_text(self.markdown() + "\n")

    def markdown(self) -> str:
        import torch

        device = torch.cuda.get_device_name() if torch.cuda.is_available() and not SMOKE else "CPU (gloo)"
        lines = [
            f"Device: {device} x {self.args.gpus}, torch {torch.__version__}, "
            f"NCCL (NCCL_NVLS_ENABLE={os.environ.get('NCCL_NVLS_ENABLE')}); model family {self.args.family}; "
            f"{self.args.steps} steps from one seed checkpoint.",
            "",
            "| layout | GPUs | rc | wall s | max rel. loss diff vs 1 GPU | loss first step | loss last step |",
            "|---|---|---|---|---|---|---|",
        ]
        for name, n, rc, secs, diff, first, last in self.rows:
            lines.append(f"| {name} | {n} | {rc} | {secs:.0f} | {diff:.2e} | {first} | {last} |")
        return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--dir", default="/tmp/plait_layouts")
    ap.add_argument("--out", default=None)
    ap.add_argument("--timeout", type=int, default=240)
    ap.add_argument("--cpu-smoke", action="store_true", help="CPU processes over gloo (checks the driver)")
    ap.add_argument("--only", default="", help=f"comma-separated layout names and parts {PARTS}")
    ap.add_argument("--skip-resume", action="store_true", help="skip the save-on-all, resume-on-half run")
    ap.add_argument("--family", default="qwen3_moe", choices=["qwen3_moe", *FAMILY_LAYOUTS])
    args = ap.parse_args()
    known = {name for name, _, _ in LAYOUTS} | (set(PARTS) if args.family == "qwen3_moe" else set())
    if args.only:
        only = set(args.only.split(","))
    elif args.family != "qwen3_moe":
        only = set(FAMILY_LAYOUTS[args.family])
    else:
        only = known - ({"resume"} if args.skip_resume else set())
    if unknown := only - known:
        ap.error(f"--only: unknown layouts or parts {sorted(unknown)}; known: {sorted(known)}")
    work = Path(args.dir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    seed = work / "seed"
    steps = [f"--steps={args.steps}", f"--init-from={seed}", "--checkpoint.enabled=false"]
    script, base = main_job(args.family)
    subprocess.run([sys.executable, str(script), *base, f"--write-seed-checkpoint={seed}"], check=True)
    results = Results(args)
    layouts = [(n, p, e) for n, p, e in LAYOUTS if n in only and p <= args.gpus]
    if skipped := sorted(n for n, p, _ in LAYOUTS if n in only and p > args.gpus):
        print(f"skipped (more than --gpus={args.gpus} processes): {', '.join(skipped)}", flush=True)
    ref: dict[int, float] = {}
    if layouts or "resume" in only:
        rc, secs, log = launch(1, work / "ref", steps, args.timeout, script, base)
        ref = losses(work / "ref")
        if rc:
            print(log)
        results.add("1 GPU (reference)", 1, rc, secs, 0.0, ref.get(1), ref.get(args.steps))
    for name, nproc, extra in layouts:
        d = work / name.replace(" ", "_")
        rc, secs, log = launch(nproc, d, steps + extra, args.timeout, script, base)
        got = losses(d)
        diff = max_rel_diff(got, ref)
        if rc or len(got) != len(ref):
            print(f"--- {name} failed (rc={rc}) ---\n{log}", flush=True)
            diff = float("nan")
        results.add(name, nproc, rc, secs, diff, got.get(1), got.get(args.steps))
    if "resume" in only:
        resume_rows(args, work, seed, ref, results)
    if "lora" in only:
        lora_rows(args, work, seed, results)
    print(results.markdown())


def resume_rows(
    args: argparse.Namespace, work: Path, seed: Path, ref: dict[int, float], results: Results
) -> None:
    """Async checkpoint saved halfway with FSDP x EP on all GPUs; resumed on half with other layouts."""
    ck = work / "ckpt"
    n, half, mid = args.gpus, max(1, args.gpus // 2), args.steps // 2
    ck_args = [
        f"--steps={args.steps}",
        f"--init-from={seed}",
        "--checkpoint.enabled=true",
        "--checkpoint.async_mode=process",
        f"--checkpoint.interval={mid}",
        "--checkpoint.keep_last=4",
    ]
    save = f"FSDP{n} x EP{n}" if n > 1 else "1 GPU"
    rc1, secs, log1 = launch(n, ck, [*ck_args, f"--mesh.data_shard={n}", f"--mesh.expert={n}"], args.timeout)
    saved = losses(ck)
    if rc1:
        print(f"--- checkpoint save failed rc={rc1} ---\n{log1}", flush=True)
    results.add(
        f"save {save} (async) @ {mid}",
        n,
        rc1,
        secs,
        max_rel_diff(saved, ref),
        saved.get(1),
        saved.get(args.steps),
    )
    if rc1:
        return
    shutil.rmtree(ck / "checkpoints" / f"step_{args.steps:08d}", ignore_errors=True)
    (ck / "metrics.jsonl").unlink(missing_ok=True)
    resume = [(f"FSDP{half}", [f"--mesh.data_shard={half}"])] if half > 1 else [("1 GPU", [])]
    if half > 1:
        resume.append((f"PP{half} 1F1B", [f"--mesh.pipeline={half}", "--pipeline.kind=1f1b"]))
    for name, extra in resume:
        d = work / f"resume_{name.replace(' ', '_')}"
        shutil.copytree(ck, d)
        rc2, secs, log2 = launch(half, d, [*ck_args, *extra], args.timeout)
        resumed = {s: v for s, v in losses(d).items() if s > mid}
        diff = max_rel_diff(resumed, ref)
        if rc2 or len(resumed) != args.steps - mid:
            print(f"--- resume {name} failed rc={rc2} ---\n{log2}", flush=True)
            diff = float("nan")
        results.add(
            f"resume {name} @ {mid} (from {save})",
            half,
            rc2,
            secs,
            diff,
            resumed.get(mid + 1),
            resumed.get(args.steps),
        )


def lora_rows(args: argparse.Namespace, work: Path, seed: Path, results: Results) -> None:
    """LoRA on 1 GPU and FSDP2 on 2 from the seed checkpoint; each adapter checked with peft.

    The "max rel. loss diff" column holds each curve against the 1-GPU LoRA one, and the "in peft" rows
    the max abs. difference of peft's logits (the exported adapter on the transformers model) from plait's.
    """
    runs = [("LoRA 1 GPU", 1, [])] + ([("LoRA FSDP2", 2, ["--mesh.data_shard=2"])] if args.gpus >= 2 else [])
    ref: dict[int, float] = {}
    for name, nproc, extra in runs:
        d = work / name.replace(" ", "_")
        rc, secs, log = launch(nproc, d, ["--base", str(seed), "--steps", str(args.steps), *LORA_BASE, *extra],
                               args.timeout, script=LORA, base=[])  # fmt: skip
        got = losses(d)
        ref = ref or got
        diff = max_rel_diff(got, ref)
        if rc or len(got) != args.steps:
            print(f"--- {name} failed (rc={rc}) ---\n{log}", flush=True)
            diff = float("nan")
        results.add(name, nproc, rc, secs, diff, got.get(1), got.get(args.steps))
        if not rc:
            results.add(
                f"{name}: adapter in peft (max abs logit diff)",
                1,
                0,
                0.0,
                peft_logit_diff(seed, d / "adapter"),
                None,
                None,
            )


def peft_logit_diff(seed: Path, adapter: Path) -> float:
    """Max |logits| difference of peft (the adapter on the transformers model) from plait (CPU, fp32)."""
    import peft
    import torch
    from plait.models import from_pretrained
    from plait.peft import import_hf_adapter
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([list(b"def main():\n    return 0\n"), list(b"import os; print(os.sep)\n")])
    base = AutoModelForCausalLM.from_pretrained(seed, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        base_logits = base(ids).logits
        theirs = peft.PeftModel.from_pretrained(base, str(adapter)).eval()(ids).logits
        ours = from_pretrained(seed).eval()
        import_hf_adapter(ours, adapter)
        our_logits = ours(input_ids=ids, return_logits=True)["logits"]
    if torch.allclose(theirs, base_logits, atol=1e-4):
        print(f"--- {adapter}: the adapter does not change the logits (training did not move it)", flush=True)
        return float("nan")
    return (our_logits - theirs).abs().max().item()


if __name__ == "__main__":
    main()
