"""Training throughput of a 1.1B Qwen3-MoE: plait's Trainer and model step next to transformers and torchtitan.

One GPU, one process per row, the same model and batch for every row:

    python3 benchmarks/training/throughput.py                 # every row; writes benchmarks/results/training.md
    python3 benchmarks/training/throughput.py --rows hf_compiled plait_trainer_compiled
    python3 benchmarks/training/throughput.py --smoke         # a tiny model on the CPU: the script runs

Model: 8 decoder layers, hidden 1024, 16 heads (4 KV heads, head dim 64), 64 experts top-8 with expert FFN 512,
vocab 151936, untied embeddings (1.14B parameters); batch 4 x 2048 tokens; bf16 parameters.

Rows (each in its own process; ``--rows`` picks some):
  hf_eager / hf_compiled          transformers Qwen3MoeForCausalLM (grouped_mm experts, SDPA, fused AdamW,
                                  router aux loss), eager / ``model.compile()``
  torchtitan_eager / _compiled    torchtitan 0.2.2's Qwen3 MoE (grouped_mm experts, fused AdamW), eager /
                                  each block compiled (fullgraph); skipped when torchtitan is not importable
  plait_step_eager / _compiled    plait's model: forward + backward + StochasticAdamW on the Trainer's own
                                  batches (packed documents, document masking, aux loss), no Trainer
  plait_trainer_eager / _compiled the main job (examples/qwen3_moe/pretrain.py) with this model
  plait_trainer_fsdp<n>           the main job on n GPUs (torchrun) at the 1-GPU row's tokens per GPU: FSDP
                                  over n (``--parallel.reshard_after_forward=false``, 4 decoder layers per
                                  FSDP unit); skipped when fewer than n GPUs are present (``--smoke``: n CPU
                                  processes over gloo)
  plait_trainer_ep<n>             the same with EP=n x FSDP=n (`all_gather` dispatch, as gpu2.toml; all
                                  layers in one FSDP unit: with EP it holds only the dense weights)
  plait_trainer_pp<n>             the same with n pipeline stages, 1F1B, 2n microbatches per step

``--model gpu1`` measures the main job's GPU model instead (the ``[model]`` table of
``examples/qwen3_moe/configs/gpu1.toml``; ``benchmarks/multigpu/scaling.py`` uses it) and writes no results file.

Each row runs ``--warmup`` steps, then times ``--steps`` steps with the device synchronised at both ends.
It prints tok/s (per GPU), MFU against the bf16 matmul rate measured at the start of the same run, and
the peak allocated GPU memory.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import tomllib
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results" / "training.md"
MODEL = {  # the Hugging Face / plait config fields of the benchmark model
    "vocab_size": 151936,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "max_position_embeddings": 4096,
    "moe_intermediate_size": 512,
    "num_experts": 64,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "router_aux_loss_coef": 0.001,
    "tie_word_embeddings": False,
}
SMOKE_MODEL = {**MODEL, "vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2, "head_dim": 16, "moe_intermediate_size": 32, "num_experts": 8,
               "num_experts_per_tok": 2}  # fmt: skip
ROWS_1GPU = [
    "hf_eager", "hf_compiled", "torchtitan_eager", "torchtitan_compiled",
    "plait_step_eager", "plait_step_compiled", "plait_trainer_eager", "plait_trainer_compiled",
]  # fmt: skip
ROWS_2GPU = ["plait_trainer_fsdp2", "plait_trainer_ep2"]
GPU1_TOML = ROOT / "examples" / "qwen3_moe" / "configs" / "gpu1.toml"


def trainer_layout(row: str, batch: int, layers: int = 8) -> tuple[int, list[str]]:
    """Processes and main-job arguments of a Trainer row (``plait_trainer_{fsdp,ep,pp}<n>``; else 1, []);
    ``layers``: the model's decoder layers."""
    m = re.fullmatch(r"plait_trainer_(fsdp|ep|pp)(\d+)", row)
    if m is None:
        return 1, []
    n = int(m[2])
    if m[1] == "pp":  # global batch batch x n sequences in microbatches of batch // 2: 2n microbatches
        return n, [f"--mesh.pipeline={n}", "--pipeline.kind=1f1b", f"--batching.microbatch_size={batch // 2}"]
    # EP rows: gpu2.toml's dispatch (every size on the device: no host sync, one graph per layer)
    expert = [f"--mesh.expert={n}", "--parallel.expert_dispatch=all_gather"] if m[1] == "ep" else []
    # Decoder layers per FSDP unit, the best of 1/2/4/8 on 2 x H200 (session 8, 8 layers): 4 with FSDP
    # alone; with EP the units hold only the small dense weights, so one unit for all layers.
    units = layers if m[1] == "ep" else 4
    return n, [
        f"--mesh.data_shard={n}",
        *expert,
        "--parallel.reshard_after_forward=false",
        f"--parallel.fsdp_layers_per_unit={units}",
    ]


def _src_path() -> None:
    for src in sorted((ROOT / "packages").glob("*/src")):
        if str(src) not in sys.path:
            sys.path.insert(0, str(src))
    sys.path.insert(0, str(ROOT / "examples" / "qwen3_moe"))


def bf16_matmul_tflops(n: int = 8192, iters: int = 20) -> float:
    """Measured dense bf16 matmul rate of this GPU (the compute ceiling for MFU)."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        a @ b
    torch.cuda.synchronize()
    return 2 * n**3 * iters / (time.perf_counter() - t0) / 1e12


def flops_per_token(model: dict[str, Any], seq_len: int) -> float:
    """Training FLOPs per token (6 x active matmul parameters + attention), as plait.models.flops counts."""
    h, layers = model["hidden_size"], model["num_hidden_layers"]
    q, kv = model["num_attention_heads"] * model["head_dim"], model["num_key_value_heads"] * model["head_dim"]
    attn = h * (q + 2 * kv) + q * h
    experts = model["num_experts_per_tok"] * 3 * h * model["moe_intermediate_size"] + h * model["num_experts"]
    active = layers * (attn + experts) + h * model["vocab_size"]
    attention_scores = layers * 2 * 2 * q * seq_len / 2  # causal QK^T and PV, half the square
    return 6 * active + 3 * attention_scores


# ------------------------------------------------------------------ batches
def _batches(
    model: dict[str, Any], batch: int, seq: int, n: int, device: str
) -> list[dict[str, torch.Tensor]]:
    """Random tokens (peers' rows): uniform over the vocabulary, labels shifted by one."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        ids = torch.randint(0, model["vocab_size"], (batch, seq + 1), generator=g)
        out.append({"input_ids": ids[:, :-1].to(device), "labels": ids[:, 1:].to(device)})
    return out


class _Profile:
    """``--profile``: a torch.profiler window of 3 steps after ``skip`` + 1 steps; prints where GPU time goes.

    ``tick()`` is called after every step (by the timed loop, or by the Trainer's ``StepEnd`` event).
    """

    def __init__(self, args: argparse.Namespace, skip: int) -> None:
        self.prof = None
        self.row = args.row
        if args.profile and int(os.environ.get("RANK", "0")) == 0:
            from torch.profiler import ProfilerActivity, profile, schedule

            self.prof = profile(
                activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                schedule=schedule(wait=skip, warmup=1, active=3, repeat=1),
            )
            self.prof.__enter__()

    def tick(self, *_: object) -> None:
        if self.prof is not None:
            self.prof.step()

    def report(self, s_per_step: float) -> None:
        if self.prof is None:
            return
        self.prof.__exit__(None, None, None)
        events = self.prof.key_averages()
        # Device time of kernels only: not the step / NCCL annotations that span them.
        annotations = ("ProfilerStep", "nccl:", "record_param_comms")
        kernels = [
            e
            for e in events
            if e.device_type == torch.autograd.DeviceType.CUDA and not e.key.startswith(annotations)
        ]
        busy = sum(e.self_device_time_total for e in kernels) / 1e6 / 3  # seconds of kernels per step
        print(events.table(sort_by="self_device_time_total", row_limit=30), flush=True)
        print("PROFILE host time (CPU total, all threads):", flush=True)
        print(events.table(sort_by="cpu_time_total", row_limit=40), flush=True)
        print(f"PROFILE kernel time {busy * 1e3:.1f} ms/step of {s_per_step * 1e3:.1f} ms/step wall "
              f"({busy / s_per_step:.0%} busy)", flush=True)  # fmt: skip
        for e in events:  # host waits on the device: what stops the host from running ahead
            if "Synchronize" in e.key or "Memcpy" in e.key or e.key == "aten::_local_scalar_dense":
                print(
                    f"PROFILE host {e.key}: {e.count / 3:.1f} calls/step, {e.cpu_time_total / 3e3:.2f} ms/step"
                )
        from torch._dynamo.utils import counters

        breaks = sum(counters["graph_break"].values())
        print(
            f"PROFILE dynamo: {breaks} graph breaks, {counters['stats']['unique_graphs']} graphs", flush=True
        )
        if trace_dir := os.environ.get("PROFILE_TRACE_DIR"):
            self.prof.export_chrome_trace(f"{trace_dir}/trace_{self.row}.json.gz")


def _timed(
    step: Callable[[int], None], warmup: int, steps: int, device: str, prof: _Profile | None = None
) -> tuple[float, float]:
    """Seconds per step over ``steps`` after ``warmup``, and peak allocated GiB.

    With ``prof`` (which skips warmup + steps), 4 more steps run after the timing for its window.
    """
    tick = prof.tick if prof is not None else (lambda: None)
    for i in range(warmup):
        step(i)
        tick()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for i in range(steps):
        step(warmup + i)
        tick()
    if device == "cuda":
        torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / steps
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan")
    if prof is not None:
        for i in range(4):
            step(warmup + steps + i)
            tick()
        prof.report(dt)
    return dt, peak


# ------------------------------------------------------------------ rows
def row_hf(args: argparse.Namespace, compiled: bool) -> dict[str, float]:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(**args.model, decoder_sparse_step=1, mlp_only_layers=[], output_router_logits=True)
    kwargs: dict[str, Any] = {"attn_implementation": "sdpa", "torch_dtype": torch.bfloat16}
    try:
        model = Qwen3MoeForCausalLM._from_config(cfg, experts_implementation="grouped_mm", **kwargs)
    except (TypeError, ValueError):  # older transformers: no experts_implementation
        model = Qwen3MoeForCausalLM._from_config(cfg, **kwargs)
    model.to(args.device).train()
    if compiled:
        model.compile()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=args.device == "cuda")
    data = _batches(args.model, args.batch, args.seq, 4, args.device)

    def step(i: int) -> None:
        b = data[i % len(data)]
        model(input_ids=b["input_ids"], labels=b["input_ids"]).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    prof = _Profile(args, skip=args.warmup + args.steps)
    return _result(args, *_timed(step, args.warmup, args.steps, args.device, prof))


def _stub_attr(attr: str) -> Any:
    if attr.startswith("__"):  # inspect and importlib probe dunders: behave like a plain module
        raise AttributeError(attr)
    return types.SimpleNamespace()


def _stub_torchtitan_imports() -> None:
    """torchtitan 0.2.2 imports packages its model code never uses (datasets, wandb, blobfile)."""
    for name in ("datasets", "wandb", "blobfile"):
        if name not in sys.modules:
            try:
                __import__(name)
            except ImportError:
                mod = types.ModuleType(name)
                mod.__dict__["__getattr__"] = _stub_attr
                sys.modules[name] = mod


def row_torchtitan(args: argparse.Namespace, compiled: bool) -> dict[str, float]:
    _stub_torchtitan_imports()
    from torchtitan.models.moe import MoEArgs
    from torchtitan.models.qwen3.model.args import Qwen3ModelArgs
    from torchtitan.models.qwen3.model.model import DecoderTrunk

    m = args.model
    targs = Qwen3ModelArgs(
        dim=m["hidden_size"], n_layers=m["num_hidden_layers"], n_heads=m["num_attention_heads"],
        n_kv_heads=m["num_key_value_heads"], vocab_size=m["vocab_size"], head_dim=m["head_dim"],
        hidden_dim=m["intermediate_size"], max_seq_len=args.seq, qk_norm=True, moe_enabled=True,
        moe_inter_dim=m["moe_intermediate_size"],
        moe_args=MoEArgs(num_experts=m["num_experts"], num_shared_experts=0, top_k=m["num_experts_per_tok"],
                         score_func="softmax", route_norm=True, score_before_experts=False,
                         use_grouped_mm=args.device == "cuda"),
    )  # fmt: skip
    with torch.device("meta"):
        model = DecoderTrunk(targs)
    model.to_empty(device=args.device)
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device(args.device))
    model.to(torch.bfloat16).train()
    if compiled:
        for name, block in model.layers.named_children():
            model.layers.register_module(name, torch.compile(block, fullgraph=True))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=args.device == "cuda")
    data = _batches(m, args.batch, args.seq, 4, args.device)

    def step(i: int) -> None:
        b = data[i % len(data)]
        logits = model(b["input_ids"])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), b["labels"].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return _result(args, *_timed(step, args.warmup, args.steps, args.device))


def _pretrain_argv(args: argparse.Namespace, run_dir: str, compiled: bool, extra: list[str]) -> list[str]:
    """The main job's command line for the benchmark model and batch (no checkpoints, no export)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    argv = ["--steps", str(args.warmup + args.steps), "--run-dir", run_dir, "--no-export",
            f"--run.device={args.device}", f"--batching.global_batch_size={args.batch * world}",
            f"--batching.microbatch_size={args.batch}", f"--batching.seq_len={args.seq}",
            "--checkpoint.enabled=false", "--logging.progress_bar=false", f"--logging.interval={args.warmup}",
            f"--parallel.compile={str(compiled).lower()}", "--data.max_files=4000"]  # fmt: skip
    if args.device == "cuda":  # the shipped GPU config: bf16 parameters, StochasticAdamW
        argv += ["--config", str(ROOT / "examples" / "qwen3_moe" / "configs" / "gpu1.toml")]
    argv += [f"--model.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in args.model.items()]
    return argv + extra


def row_plait_trainer(args: argparse.Namespace, compiled: bool, extra: list[str]) -> dict[str, float]:
    _src_path()
    import pretrain  # examples/qwen3_moe/pretrain.py
    from plait.loop.events import StepEnd

    world = int(os.environ.get("WORLD_SIZE", "1"))
    prof = _Profile(args, skip=args.warmup - 1)
    if prof.prof is not None:  # profile Trainer steps warmup+1 .. warmup+3 (ticked at each step's end)
        build = pretrain.build_trainer

        def build_and_tick(*a: Any, **k: Any) -> Any:
            trainer = build(*a, **k)
            trainer.subscribe(StepEnd, prof.tick)
            return trainer

        pretrain.build_trainer = build_and_tick
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = tmp if world == 1 else "/tmp/plait_throughput_run"  # one run directory for all ranks
        pretrain.main(_pretrain_argv(args, run_dir, compiled, extra))
        if int(os.environ.get("RANK", "0")) != 0:  # the main rank writes metrics.jsonl and reports
            return {}
        records = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in records if r.get("step", 0) > args.warmup and "tokens_per_s" in r]
    if not timed:
        raise RuntimeError(f"no metrics past step {args.warmup} in metrics.jsonl: {records[-1:]}")
    tps = sum(r["tokens_per_s"] for r in timed) / len(timed)
    peak = max((r.get("mem_allocated_gib") or float("nan")) for r in timed)
    prof.report(args.batch * args.seq * world / tps)
    return _result(args, args.batch * args.seq * world / tps, peak)


def row_plait_step(args: argparse.Namespace, compiled: bool) -> dict[str, float]:
    """plait's model on the Trainer's batches, with no Trainer: the floor the Trainer is measured against."""
    _src_path()
    import pretrain
    from plait.kernels import StochasticAdamW
    from plait.models import CausalLMProvider, ParallelConfig
    from plait.models.qwen3 import Qwen3MoeConfig

    cfg = Qwen3MoeConfig(**args.model)
    bf16 = args.device == "cuda"
    provider = CausalLMProvider(
        cfg, parallel=ParallelConfig(compile=compiled), dtype=torch.bfloat16 if bf16 else None
    )
    model = provider.build_stage(0, 1)
    if compiled:
        for layer in model.decoder_layers():
            layer.compile()
    provider.materialize(model, args.device)
    model.train()
    opt = (
        StochasticAdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
        if bf16
        else torch.optim.AdamW(model.parameters(), lr=1e-4)
    )
    data_cfg = pretrain.DataConfig(max_files=4000)
    ds = pretrain.build_dataset(data_cfg, args.seq)
    batches = []
    for i in range(4):
        rows = [ds[i * args.batch + j] for j in range(args.batch)]
        batches.append({k: torch.stack([r[k] for r in rows]).to(args.device) for k in rows[0]})

    def step(i: int) -> None:
        b = batches[i % len(batches)]
        out = model(input_ids=b["input_ids"], labels=b["labels"], position_ids=b["position_ids"],
                    document_ids=b["document_ids"])  # fmt: skip
        n = (b["labels"] != -100).sum()
        ((out["loss_sum"] + out["aux_loss"] * n) / n).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    prof = _Profile(args, skip=args.warmup + args.steps)
    return _result(args, *_timed(step, args.warmup, args.steps, args.device, prof))


def _result(args: argparse.Namespace, s_per_step: float, peak_gib: float) -> dict[str, float]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    tokens = args.batch * args.seq * world
    return {"tok_s_per_gpu": tokens / s_per_step / world, "s_per_step": s_per_step, "peak_gib": peak_gib}


def run_row(args: argparse.Namespace) -> dict[str, float]:
    name = args.row
    if name.startswith("hf_"):
        return row_hf(args, name == "hf_compiled")
    if name.startswith("torchtitan_"):
        return row_torchtitan(args, name == "torchtitan_compiled")
    if name.startswith("plait_step_"):
        return row_plait_step(args, name == "plait_step_compiled")
    extra = trainer_layout(name, args.batch, int(args.model["num_hidden_layers"]))[1]
    return row_plait_trainer(args, name != "plait_trainer_eager", extra + args.trainer_args.split())


# ------------------------------------------------------------------ driver
def _spawn(row: str, args: argparse.Namespace) -> dict[str, Any]:
    common = ["--row", row, "--steps", str(args.steps), "--warmup", str(args.warmup)]
    common += ["--smoke"] if args.smoke else []
    common += ["--profile"] if args.profile else []
    common += [f"--trainer-args={args.trainer_args}"] if args.trainer_args else []
    common += ["--model", args.model_name]
    nproc = trainer_layout(row, args.batch)[0]
    if nproc > 1:
        if not args.smoke and torch.cuda.device_count() < nproc:
            print(f"{row}: skipped, needs {nproc} GPUs ({torch.cuda.device_count()} present)", flush=True)
            return {"row": row, "skipped": f"needs {nproc} GPUs ({torch.cuda.device_count()} present)"}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
        cmd += [__file__, *common]
    else:
        cmd = [sys.executable, __file__, *common]
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.row_timeout)
    except subprocess.TimeoutExpired:
        print(f"--- {row} timed out after {args.row_timeout:.0f} s", flush=True)
        return {"row": row, "skipped": f"timed out after {args.row_timeout:.0f} s"}
    results = [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if args.profile:
        body = [ln for ln in proc.stdout.splitlines() if not ln.startswith("RESULT ")]
        print(f"--- {row} profile\n" + "\n".join(body), flush=True)
    if proc.returncode != 0 or not results:
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
        print(f"--- {row} failed (rc {proc.returncode}):\n" + "\n".join(tail), flush=True)
        return {"row": row, "skipped": f"failed (rc {proc.returncode}): {tail[-1] if tail else ''}"[:200]}
    res = {"row": row, **results[0], "wall_s": time.time() - t0}
    print(f"{row}: {res}", flush=True)
    return res


def _table(results: list[dict[str, Any]], peak_tflops: float, fpt: float) -> str:
    by = {r["row"]: r for r in results}
    lines = ["| row | tok/s per GPU | MFU | peak GiB | vs hf_compiled | vs plait_step (same mode) |",
             "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in results:
        if "skipped" in r:
            lines.append(f"| {r['row']} | {r['skipped']} | | | | |")
            continue
        tps = r["tok_s_per_gpu"]
        mfu = fpt * tps / (peak_tflops * 1e12) if peak_tflops == peak_tflops else float("nan")
        base = by.get("hf_compiled", {}).get("tok_s_per_gpu")
        mode = "eager" if r["row"].endswith("eager") else "compiled"
        step = by.get(f"plait_step_{mode}", {}).get("tok_s_per_gpu")
        ratio = f"{tps / base:.2f}x" if base else ""
        vs_step = f"{tps / step:.2f}x" if step and r["row"].startswith("plait_trainer") else ""
        lines.append(
            f"| {r['row']} | {tps / 1e3:.1f}k | {mfu:.1%} | {r['peak_gib']:.1f} | {ratio} | {vs_step} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (``argv``, default ``sys.argv``) with the model, device and batch it implies."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--rows",
        nargs="+",
        default=None,
        help=f"rows to run (default: all): {ROWS_1GPU + ROWS_2GPU}, or plait_trainer_{{fsdp,ep,pp}}<n>",
    )
    ap.add_argument("--row", help=argparse.SUPPRESS)  # internal: run one row in this process
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--row-timeout", type=float, default=900)
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU, 2 steps (checks the script)")
    ap.add_argument("--no-write", action="store_true", help="do not write benchmarks/results/training.md")
    ap.add_argument(
        "--profile",
        action="store_true",
        help="plait and transformers rows: print a kernel-time table of 3 steps",
    )
    ap.add_argument(
        "--trainer-args", default="", help="more main-job arguments for the Trainer rows (space-separated)"
    )
    ap.add_argument(
        "--model",
        dest="model_name",
        choices=["benchmark", "gpu1"],
        default="benchmark",
        help="the 1.14B benchmark model, or the main job's GPU model (configs/gpu1.toml's [model])",
    )
    args = ap.parse_args(argv)
    if bad := [r for r in args.rows or [] if r not in ROWS_1GPU and trainer_layout(r, 2)[0] == 1]:
        ap.error(f"--rows: unknown {bad}; known: {ROWS_1GPU} and plait_trainer_{{fsdp,ep,pp}}<n> (n >= 2)")
    if args.smoke:
        args.model = SMOKE_MODEL
    elif args.model_name == "gpu1":
        args.model = tomllib.loads(GPU1_TOML.read_text())["model"]
    else:
        args.model = MODEL
    args.device = "cpu" if args.smoke or not torch.cuda.is_available() else "cuda"
    args.batch, args.seq = (2, 64) if args.smoke else (4, 2048)
    if args.smoke:
        args.steps, args.warmup = 2, 1
    if args.steps % args.warmup:
        ap.error("--steps must be a multiple of --warmup (the Trainer rows log every --warmup steps)")
    return args


def measure(args: argparse.Namespace, rows: list[str]) -> tuple[list[dict[str, Any]], float, float, str]:
    """Run ``rows`` (one process or torchrun each): results, bf16 TFLOP/s, FLOPs per token, environment."""
    peak = bf16_matmul_tflops() if args.device == "cuda" else float("nan")
    fpt = flops_per_token(args.model, args.seq)
    dev = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (smoke)"
    import triton

    env = (f"{dev}, torch {torch.__version__}, triton {triton.__version__}, "
           f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC")  # fmt: skip
    print(f"{env}; bf16 matmul {peak:.0f} TFLOP/s; {fpt / 1e9:.2f} GFLOP/token", flush=True)
    return [_spawn(r, args) for r in rows], peak, fpt, env


def main() -> None:
    args = parse_args()
    if args.row:
        if args.device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        res = run_row(args)
        if int(os.environ.get("RANK", "0")) == 0:
            print("RESULT " + json.dumps(res), flush=True)
        return

    results, peak, fpt, env = measure(args, args.rows or ROWS_1GPU + ROWS_2GPU)
    table = _table(results, peak, fpt)
    print(table)
    if not args.no_write and not args.smoke and args.model_name == "benchmark":
        RESULTS.write_text(
            "# Training throughput: plait vs transformers and torchtitan\n\n"
            f"`python3 benchmarks/training/throughput.py {' '.join(sys.argv[1:])}`: {env}. "
            f"bf16 matmul rate measured in the same run: {peak:.0f} TFLOP/s (MFU denominator). "
            f"Model: Qwen3-MoE 8 layers, hidden 1024, 64 experts top-8, expert FFN 512, vocab 151936 "
            f"(1.14B parameters), batch {args.batch} x {args.seq} per GPU, bf16; {args.warmup} warm-up steps, "
            f"{args.steps} timed; one process per row.\n\n{table}\n"
        )


if __name__ == "__main__":
    main()
