"""Training throughput on one GPU: plait's Trainer and model step next to transformers and torchtitan.

    python3 -m benchmarks.run --suite training              # what the results table was measured with
    python3 -m benchmarks.training.throughput               # the MoE and dense rows; writes results/training.md
    python3 -m benchmarks.training.throughput --rows moe.hf_compiled moe.plait_trainer_compiled
    python3 -m benchmarks.training.throughput --check       # 3 runs per row against results/training.md
    python3 -m benchmarks.training.throughput --smoke       # a tiny model on the CPU: the script runs

The models are ``workloads.py``'s entries (one per model family: a Hugging Face config dict, a batch,
the transformers class, the torchtitan builder): ``moe``, a 1.14B Qwen3-MoE (8 layers, hidden 1024, 64
experts top-8, expert FFN 512, vocab 151936, batch 4 x 2048) and ``dense``, Qwen3-1.7B shapes (batch 2 x
4096, compiled rows). A row is ``<workload>.<implementation>`` (a bare implementation means ``moe``):
  hf_eager / hf_compiled          transformers (SDPA, fused AdamW; MoE: grouped_mm experts, router aux
                                  loss), eager / ``model.compile()``
  torchtitan_eager / _compiled    torchtitan 0.2.2's model of the family (fused AdamW), eager / each block
                                  compiled (fullgraph); the packages torchtitan imports but its models never
                                  use (datasets, wandb, tensorboard, blobfile, tiktoken) are stubbed with
                                  all their submodules when missing
  plait_step_eager / _compiled    plait's model: forward + backward + StochasticAdamW, no Trainer (MoE: the
                                  Trainer's own batches, packed documents, document masking, aux loss)
  plait_step_fp8_compiled         the same, compiled, with float8 linears (``ParallelConfig.float8``, recipe
                                  ``--fp8-recipe``; dense and llama3_8b workloads; its "vs plait step" column
                                  is the float8 speed-up over bf16)
  plait_trainer_eager / _compiled the MoE main job (plait train) with this model (on CUDA with ``gpu1.toml``'s
                                  settings: the compiled row's layers replayed as CUDA graphs)
  plait_trainer_no_graphs         the same, compiled, its layers launched kernel by kernel
                                  (``--parallel.cuda_graphs=false``)
  plait_trainer_fsdp<n>           the main job on n GPUs (torchrun) at the 1-GPU row's tokens per GPU: FSDP
                                  over n (``--parallel.reshard_after_forward=false``, 4 decoder layers per
                                  FSDP unit); skipped when fewer than n GPUs are present (``--smoke``: n CPU
                                  processes over gloo)
  plait_trainer_ep<n>             the same with EP=n x FSDP=n (`all_gather` dispatch: no host sync; all
                                  layers in one FSDP unit: with EP it holds only the dense weights)
  plait_trainer_pp<n>             the same with n pipeline stages, 1F1B, 2n microbatches per step, no CUDA
                                  graphs (they need one stage per process; the FSDP and EP rows keep them)
  plait_step_fsdp<n>              plait_step_compiled on n GPUs: FSDP2 over n (``provider.parallelize``), once per
                                  ``--variants`` entry (ParallelConfig overrides)
  torchtitan_fsdp<n>              torchtitan_compiled on n GPUs: torchtitan 0.2.2's own ``apply_fsdp``
                                  (bf16 gradient reduction, like plait's rows)

Every row times ``--windows`` windows of ``--steps`` steps (the median window's tok/s and the spread over the
windows); ``--profile`` adds the :func:`timeline` of 3 more steps (communication and its exposed part, the
host's time per step, the GPU's idle fraction); with ``PROFILE_PYTHON_DIR=D`` in the environment it also
writes a cProfile of those steps (rank 0) to ``D/<row>.pstats`` and prints its costliest functions, and
``PROFILE_TRACE_DIR=D`` writes their Chrome trace.

``--activation-checkpointing full|selective`` checkpoints every decoder layer of the plait rows (the memory /
time trade-off of ``ParallelConfig.activation_checkpointing``).

``--model gpu1`` measures the main job's GPU model instead of the MoE entry (the ``[model]`` table of
``examples/qwen3_moe/configs/gpu1.toml``) and writes no results file.

Each row runs ``--warmup`` steps, then times ``--steps`` steps with the device synchronised at both ends.
It prints tok/s (per GPU), MFU against the bf16 matmul rate measured at the start of the same run, the
peak allocated GPU memory, and one verdict line per target of ``workloads.TARGETS``. The table's ``id``
column names each row for ``--check``, which runs every row three times and exits 1 naming each row whose
median tok/s is more than 5% below the committed table's.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import json
import os
import pstats
import re
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.regression import (
    device_mismatch,
    median_rows,
    parse_table,
    regressions,
    report,
    row_id,
)
from benchmarks.training.workloads import (
    DEFAULT_WORKLOADS,
    TARGETS,
    WORKLOADS,
    Workload,
    stub_missing_modules,
)

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results" / "training.md"
CHECK_RUNS = 3
ROWS_2GPU = ["moe.plait_trainer_fsdp2", "moe.plait_trainer_ep2"]
GPU1_TOML = ROOT / "examples" / "qwen3_moe" / "configs" / "gpu1.toml"


def trainer_layout(row: str, batch: int, layers: int = 8) -> tuple[int, list[str]]:
    """Processes and main-job arguments of a row: ``plait_trainer_{fsdp,ep,pp}<n>`` (the main job's flags),
    ``plait_step_fsdp<n>`` / ``torchtitan_fsdp<n>`` (n processes, no flags); else 1, [].
    ``layers``: the model's decoder layers."""
    if (m := re.search(r"_fsdp(\d+)$", row)) and "plait_trainer" not in row:
        return int(m[1]), []
    m = re.search(r"plait_trainer_(fsdp|ep|pp)(\d+)$", row)
    if m is None:
        return 1, []
    n = int(m[2])
    if m[1] == "pp":  # global batch batch x n sequences in microbatches of batch // 2: 2n microbatches
        return n, [
            f"--mesh.pipeline={n}", "--pipeline.kind=1f1b", f"--batching.microbatch_size={batch // 2}",
            "--parallel.cuda_graphs=false",  # graphs need one stage per process
        ]  # fmt: skip
    # EP rows: the all-gather dispatch (every size on the device: no host sync, one graph per layer)
    expert = [f"--mesh.expert={n}", "--parallel.expert_dispatch=all_gather"] if m[1] == "ep" else []
    # Decoder layers per FSDP unit, the best of 1/2/4/8 on 2 x H200 (8 layers): 4 with FSDP alone; with
    # EP the units hold only the small dense weights, so one unit for all layers.
    units = layers if m[1] == "ep" else 4
    return n, [
        f"--mesh.data_shard={n}",
        *expert,
        "--parallel.reshard_after_forward=false",
        f"--parallel.fsdp_layers_per_unit={units}",
    ]


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
    """Training FLOPs per token of the workload's model, as plait counts them for every family
    (``plait.models.flops_per_token``: 6 x active matmul parameters + attention without the causal
    halving, torchtitan's convention; sliding windows and MLA head sizes counted)."""
    from plait.models import config_from_hf
    from plait.models import flops_per_token as count

    return count(config_from_hf(dict(model)), seq_len)


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
        self.python: cProfile.Profile | None = None  # PROFILE_PYTHON_DIR: cProfile of the profiled steps
        self.ticks, self.skip = 0, skip
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
            self.ticks += 1
            if self.ticks == self.skip + 1 and os.environ.get("PROFILE_PYTHON_DIR"):
                self.python = cProfile.Profile()
                self.python.enable()
            elif self.python is not None and self.ticks == self.skip + 4:  # the 3 profiled steps
                self.python.disable()

    def report(self, s_per_step: float) -> dict[str, float]:
        """Print the kernel and host tables; return the window's timeline summary (:func:`timeline`)."""
        if self.prof is None:
            return {}
        self.prof.__exit__(None, None, None)
        if self.python is not None:
            self.python.disable()  # (already, unless the run ended inside the window)
            path = Path(os.environ["PROFILE_PYTHON_DIR"]) / f"{self.row}.pstats"
            self.python.dump_stats(path)
            print("PROFILE python (cProfile of the profiled steps, by own time):", flush=True)
            pstats.Stats(self.python, stream=sys.stdout).sort_stats("tottime").print_stats(40)
        summary = timeline(self.prof.events(), s_per_step, steps=3)
        print("TIMELINE " + json.dumps(summary), flush=True)
        events = self.prof.key_averages()
        # Device time of kernels only: not the annotations that span them.
        kernels = [
            e for e in events if e.device_type == torch.autograd.DeviceType.CUDA and not _annotation(e)
        ]
        busy = sum(e.self_device_time_total for e in kernels) / 1e6 / 3  # seconds of kernels per step
        print(events.table(sort_by="self_device_time_total", row_limit=50), flush=True)
        print("PROFILE host time (CPU total, all threads):", flush=True)
        print(events.table(sort_by="cpu_time_total", row_limit=40), flush=True)
        print(f"PROFILE kernel time {busy * 1e3:.1f} ms/step of {s_per_step * 1e3:.1f} ms/step wall "
              f"({busy / s_per_step:.0%} busy)", flush=True)  # fmt: skip
        for key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaGraphLaunch"):  # launches the host issues
            n = sum(e.count for e in events if e.key == key)
            ms = sum(e.cpu_time_total for e in events if e.key == key) / 3e3
            print(f"PROFILE host {key}: {n / 3:.0f} calls/step, {ms:.2f} ms/step", flush=True)
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
        return summary


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def _minus(xs: list[tuple[float, float]], ys: list[tuple[float, float]]) -> float:
    """Length of the union ``xs`` outside the union ``ys`` (both sorted and disjoint)."""
    total, j = 0.0, 0
    for a, b in xs:
        covered = 0.0
        while j < len(ys) and ys[j][1] <= a:
            j += 1
        k = j
        while k < len(ys) and ys[k][0] < b:
            covered += min(b, ys[k][1]) - max(a, ys[k][0])
            k += 1
        total += (b - a) - covered
    return total


def _annotation(event: Any) -> bool:
    """Whether a profiler event on the device is a region that spans kernels (the step, a ``record_function``
    such as the optimizer's step, NCCL's), not a kernel."""
    return bool(event.is_user_annotation) or event.key.startswith(
        ("ProfilerStep", "nccl:", "record_param_comms")
    )


def timeline(events: Any, s_per_step: float, steps: int) -> dict[str, float]:
    """Where a profiled window of ``steps`` steps spends its time, per step:

    - ``comm_ms``: time some NCCL kernel runs; ``exposed_comm_ms``: of that, time no other kernel runs
      (communication the step waits for);
    - ``gpu_idle``: fraction of the time with no kernel running at all;
    - ``host_ms``: the host's time in the profiled steps less its waits on the device (stream, event
      and device synchronisations): how long the host takes to issue a step (profiler overhead included).

    The device times are fractions of the window from its first kernel to its last (which also holds
    work the host queued before the window: it runs ahead), scaled to ``s_per_step``, the step time
    measured without the profiler.
    """
    kernels, comm, waits, steps_cpu = [], [], [], []
    for e in events:
        r = (e.time_range.start, e.time_range.end)
        if e.device_type == torch.autograd.DeviceType.CUDA:
            if not _annotation(e):
                (comm if "nccl" in e.name.lower() else kernels).append(r)
        elif e.name.startswith("ProfilerStep"):
            steps_cpu.append(r)
        elif "Synchronize" in e.name:
            waits.append(r)
    compute, nccl = _union(kernels), _union(comm)
    every = _union(kernels + comm)
    window = (every[-1][1] - every[0][0]) if every else 0.0
    scale = s_per_step * 1e3 / window if window else 0.0  # window microseconds -> milliseconds per step
    host = _length(_union(steps_cpu)) - _length(_union(waits))
    return {
        "comm_ms": _length(nccl) * scale,
        "exposed_comm_ms": _minus(nccl, compute) * scale,
        "gpu_idle": 1.0 - _length(every) / window if window else 0.0,
        "host_ms": host * 1e-3 / steps,
    }


def _timed(
    step: Callable[[int], None],
    args: argparse.Namespace,
    prof: _Profile | None = None,
) -> tuple[list[float], float, dict[str, float]]:
    """Seconds per step of each of ``args.windows`` windows of ``args.steps`` steps after ``args.warmup``,
    peak allocated GiB and, with ``prof`` (which skips the timed steps), the timeline of 4 more steps."""
    tick = prof.tick if prof is not None else (lambda: None)
    warmup, steps, device = args.warmup, args.steps, args.device
    for i in range(warmup):
        step(i)
        tick()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    dts = []
    for w in range(args.windows):
        t0 = time.perf_counter()
        for i in range(steps):
            step(warmup + w * steps + i)
            tick()
        if device == "cuda":
            torch.cuda.synchronize()
        dts.append((time.perf_counter() - t0) / steps)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan")
    summary: dict[str, float] = {}
    if prof is not None:
        for i in range(4):
            step(warmup + args.windows * steps + i)
            tick()
        summary = prof.report(statistics.median(dts))
    return dts, peak, summary


# ------------------------------------------------------------------ rows
def row_hf(args: argparse.Namespace, compiled: bool) -> dict[str, float]:
    import transformers

    w: Workload = args.workload
    cfg = transformers.AutoConfig.for_model(**args.model, **w.hf_extra)
    kwargs: dict[str, Any] = {"attn_implementation": "sdpa", "torch_dtype": torch.bfloat16}
    model_cls = getattr(transformers, w.hf_class)
    try:
        model = model_cls._from_config(cfg, **{**kwargs, **w.hf_kwargs})
    except (TypeError, ValueError):  # older transformers: no experts_implementation
        model = model_cls._from_config(cfg, **kwargs)
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

    prof = _Profile(args, skip=args.warmup + args.steps * args.windows)
    return _result(args, *_timed(step, args, prof))


def _world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def row_torchtitan(args: argparse.Namespace, compiled: bool) -> dict[str, float]:
    w: Workload = args.workload
    if w.titan is None:
        raise RuntimeError(f"workload {w.name!r} has no torchtitan builder")
    stub_missing_modules()
    model = w.titan(args.model, args.seq)
    model.to_empty(device=args.device)
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device(args.device))
    model.to(torch.bfloat16).train()
    if compiled:
        for name, block in model.layers.named_children():
            # not fullgraph: torchtitan's gpt-oss experts branch on a tensor's value (a graph break)
            model.layers.register_module(name, torch.compile(block))
    if _world() > 1:  # torchtitan's own FSDP2 plan: embeddings, each block, norm + output, the root
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torchtitan.models.llama4.infra.parallelize import apply_fsdp

        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
        mesh = init_device_mesh(args.device, (_world(),))
        # bf16 gradient reduction like plait's rows (torchtitan's default reduces in fp32: twice the bytes)
        apply_fsdp(model, mesh, param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, pp_enabled=False)
        if args.device != "cuda":  # gloo has no PREMUL_SUM (torchtitan's divide factor of 1)
            from torch.distributed.fsdp import FSDPModule

            for m in model.modules():
                if isinstance(m, FSDPModule):
                    m.set_force_sum_reduction_for_comms(True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=args.device == "cuda")
    data = _batches(args.model, args.batch, args.seq, 4, args.device)

    masks = getattr(model, "get_attention_masks", None)  # torchtitan's FlexAttention models take masks

    def step(i: int) -> None:
        b = data[i % len(data)]
        if masks is not None and getattr(model.model_args, "attn_type", "sdpa") == "flex":
            # built each step from the batch, as torchtitan's trainer does (causal: no tokenizer read)
            logits = model(b["input_ids"], masks(b["input_ids"], tokenizer=None))
        else:
            logits = model(b["input_ids"])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), b["labels"].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    prof = _Profile(args, skip=args.warmup + args.steps * args.windows)
    result = _result(args, *_timed(step, args, prof))
    if _world() > 1:
        import torch.distributed as dist

        dist.destroy_process_group()
    return result


def _trainer_steps(args: argparse.Namespace) -> tuple[int, int]:
    """A Trainer row's warm-up (``--warmup`` rounded up to whole logging intervals of ``--steps``) and its
    total step count (4 more steps for the profile's window)."""
    warm = -(-args.warmup // args.steps) * args.steps
    return warm, warm + args.steps * args.windows + (4 if args.profile else 0)


def _pretrain_argv(args: argparse.Namespace, run_dir: str, compiled: bool, extra: list[str]) -> list[str]:
    """The main job's command line for the benchmark model and batch (no checkpoints, no export)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    argv = ["--steps", str(_trainer_steps(args)[1]), "--run-dir", run_dir, "--no-export",
            f"--run.device={args.device}", f"--batching.global_batch_size={args.batch * world}",
            f"--batching.microbatch_size={args.batch}", f"--batching.seq_len={args.seq}",
            "--checkpoint.enabled=false", "--evaluation.enabled=false", "--logging.progress_bar=false", f"--logging.interval={args.steps}",
            f"--parallel.compile={str(compiled).lower()}", "--data.max_files=4000"]  # fmt: skip
    if not compiled:  # the GPU config's CUDA graphs are the compiled layers'
        argv.append("--parallel.cuda_graphs=false")
    if args.device == "cuda":  # the shipped GPU config: bf16 parameters, StochasticAdamW
        argv += ["--config", str(ROOT / "examples" / "qwen3_moe" / "configs" / "gpu1.toml")]
    fields = {k: v for k, v in args.model.items() if k != "model_type"}
    argv += [f"--model.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in fields.items()]
    return argv + extra


def row_plait_trainer(args: argparse.Namespace, compiled: bool, extra: list[str]) -> dict[str, float]:
    from plait.loop.events import StepEnd
    from plait.train.job import TrainingJob
    from plait.train.train import main as train_main

    world = int(os.environ.get("WORLD_SIZE", "1"))
    warm = _trainer_steps(args)[0]
    timed_end = warm + args.steps * args.windows
    prof = _Profile(args, skip=timed_end)
    load = _ExpertLoad(warm, timed_end)
    build = TrainingJob.trainer

    def build_and_subscribe(job: TrainingJob, **k: Any) -> Any:
        trainer = build(job, **k)
        trainer.subscribe(StepEnd, prof.tick)  # the profile: the 3 steps after the timed ones
        trainer.subscribe(StepEnd, lambda e: load.read(trainer.model_parts, e.step))
        return trainer

    TrainingJob.trainer = build_and_subscribe  # type: ignore[method-assign]
    try:
        with tempfile.TemporaryDirectory() as tmp:
            run_dir = tmp if world == 1 else "/tmp/plait_throughput_run"  # one run directory for all ranks
            train_main(_pretrain_argv(args, run_dir, compiled, extra))
            if int(os.environ.get("RANK", "0")) != 0:  # the main rank writes metrics.jsonl and reports
                return {}
            records = [
                json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
            ]
    finally:
        TrainingJob.trainer = build  # type: ignore[method-assign]
    timed = [r for r in records if warm < r.get("step", 0) <= timed_end and "tokens_per_s" in r]
    if len(timed) != args.windows:
        raise RuntimeError(
            f"{len(timed)} intervals of metrics in steps {warm + 1}..{timed_end}: {records[-1:]}"
        )
    s_per_step = [args.batch * args.seq * world / r["tokens_per_s"] for r in timed]  # one window per interval
    peak = max((r.get("mem_allocated_gib") or float("nan")) for r in timed)
    return _result(args, s_per_step, peak, {**prof.report(statistics.median(s_per_step)), **load.report()})


class _ExpertLoad:
    """The routing balance of a MoE Trainer row as expert parallelism meets it: for each timed step and
    router, the assignments of the busiest of ``ep`` equal ranges of experts (what one EP rank of ``ep``
    computes) over their mean, averaged (``expert_load_ep2``, ``expert_load_ep4``; 1.0 is balanced, and an
    EP step waits for its busiest rank). From rank 0's tokens (with EP, the other ranks' add to its load).

    ``expert_load_ep{2,4}_placed``: the same when each step's experts sit where the step before's loads
    would place them (the heaviest first, each to the least loaded rank with room): the best that moving
    experts between ranks (EPLB-like placement) can do when it follows the routing one step late."""

    def __init__(self, first: int, last: int) -> None:
        self.first, self.last = first, last
        self.steps: list[list[torch.Tensor]] = []

    def read(self, parts: list[Any], step: int) -> None:
        """After each step: the routers' counts of the step (read and reset on the device: no host wait)."""
        from plait.moe import expert_load_stats

        counts = [c for part in parts for c in expert_load_stats(part).values()]
        if self.first <= step <= self.last:  # the step before the timed ones: the first placement's loads
            self.steps.append(counts)

    @staticmethod
    def _busiest(counts: torch.Tensor, ep: int) -> float:
        share = counts.view(ep, -1).sum(1).float()
        return (share.max() / share.mean()).item()

    @staticmethod
    def _placement(loads: torch.Tensor, ep: int) -> torch.Tensor:
        """Experts in rank order: the heaviest first, each to the least loaded rank with room left."""
        per_rank = loads.numel() // ep
        ranks: list[list[int]] = [[] for _ in range(ep)]
        totals = [0] * ep
        for e in loads.argsort(descending=True, stable=True).tolist():
            r = min((r for r in range(ep) if len(ranks[r]) < per_rank), key=totals.__getitem__)
            ranks[r].append(e)
            totals[r] += int(loads[e])
        return torch.tensor([e for r in ranks for e in r])

    def report(self) -> dict[str, float]:
        out = {}
        for ep in (2, 4):
            pairs = [
                (prev.cpu(), now.cpu())
                for before, after in zip(self.steps, self.steps[1:])
                for prev, now in zip(before, after)
                if now.numel() % ep == 0
            ]
            if pairs:
                out[f"expert_load_ep{ep}"] = statistics.mean(self._busiest(now, ep) for _, now in pairs)
                out[f"expert_load_ep{ep}_placed"] = statistics.mean(
                    self._busiest(now[self._placement(prev, ep)], ep) for prev, now in pairs
                )
        return out


def _plait_provider(args: argparse.Namespace, compiled: bool, overrides: dict[str, Any] | None = None) -> Any:
    """plait's provider of the workload's model (bf16 parameters on CUDA): compiled per decoder layer,
    float8 linears for the ``_fp8`` rows, ``--activation-checkpointing``, and ``overrides`` of its
    ``ParallelConfig``."""
    from plait.models import CausalLMProvider, Float8Training, ParallelConfig, config_from_hf

    # emulated float8 GEMMs on the CPU (--smoke): the script's path, not its speed
    fp8 = "_fp8" in args.row
    f8 = Float8Training(recipe=args.fp8_recipe if fp8 else None, emulate=fp8 and args.device != "cuda")
    parallel = ParallelConfig(
        compile=compiled,
        float8=f8,
        activation_checkpointing={"mode": args.activation_checkpointing},
        **(overrides or {}),
    )
    dtype = torch.bfloat16 if args.device == "cuda" else None
    return CausalLMProvider(config_from_hf(args.model), parallel=parallel, dtype=dtype, seed=0)


def _trainer_batches(args: argparse.Namespace) -> list[dict[str, torch.Tensor]]:
    """Four batches of the MoE main job's own data (packed documents with their positions and ids)."""
    from plait.loop.data import Corpus, DataConfig

    ds = Corpus(DataConfig(max_files=4000), args.seq).split("train")
    batches = []
    for i in range(4):
        rows = [ds[i * args.batch + j] for j in range(args.batch)]
        batches.append({k: torch.stack([r[k] for r in rows]).to(args.device) for k in rows[0]})
    return batches


def row_plait_step(args: argparse.Namespace, compiled: bool) -> dict[str, Any]:
    """plait's model with no Trainer: the floor the Trainer is measured against. Over ``WORLD_SIZE`` > 1
    processes it is sharded by ``provider.parallelize`` (FSDP2 over ``data_shard``), once per
    ``--variants`` entry (ParallelConfig overrides), each variant timed after the previous one is freed."""
    from plait.dist_core import DeviceMeshParameters, DistributedContext

    ctx = None
    if _world() > 1:
        ctx = DistributedContext.from_env(DeviceMeshParameters(data_shard=_world()), device=args.device)
    if args.workload.name == "moe":
        batches = _trainer_batches(args)
    else:  # the peers' random tokens
        batches = _batches(args.model, args.batch, args.seq, 4, args.device)
    results = {}
    for name, overrides in json.loads(args.variants).items():
        results[name] = _plait_step(args, compiled, overrides, ctx, batches)
        if args.device == "cuda":
            torch.cuda.empty_cache()
    if ctx is not None:
        ctx.shutdown()
    return results[""] if list(results) == [""] else {"variants": results}


def _plait_step(
    args: argparse.Namespace,
    compiled: bool,
    overrides: dict[str, Any],
    ctx: Any,
    batches: list[dict[str, torch.Tensor]],
) -> dict[str, Any]:
    """Build plait's model with ``overrides`` of its ParallelConfig, time its steps."""
    from plait.dist_core import parse_dtype
    from plait.kernels import StochasticAdamW

    provider = _plait_provider(args, compiled, overrides)
    model = provider.parallelize(provider.build_stage(0, 1), ctx)
    provider.materialize(model, args.device)
    model.train()
    opt = (
        StochasticAdamW(
            model.parameters(),
            lr=1e-4,
            weight_decay=0.1,
            moment_dtype=parse_dtype(args.plait_moments),
            seed=0,
        )
        if args.device == "cuda"
        else torch.optim.AdamW(model.parameters(), lr=1e-4)
    )

    def step(i: int) -> None:
        b = batches[i % len(batches)]
        inputs = {k: b[k] for k in ("input_ids", "labels", "position_ids", "document_ids") if k in b}
        out = model(**inputs)
        n = (b["labels"] != -100).sum()
        loss = out["loss_sum"] / n
        if "aux_loss" in out:
            loss = loss + out["aux_loss"]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    prof = _Profile(args, skip=args.warmup + args.steps * args.windows)
    return _result(args, *_timed(step, args, prof))


def _result(
    args: argparse.Namespace,
    s_per_step: list[float],
    peak_gib: float,
    summary: dict[str, float] | None = None,
) -> dict[str, Any]:
    """tok/s per GPU (the median window), its spread over the windows ((max - min) / median), peak GiB
    and the profile's timeline."""
    tps = sorted(args.batch * args.seq / dt for dt in s_per_step)  # this rank's tokens: equal per GPU
    mid = statistics.median(tps)
    return {"tok_s_per_gpu": mid, "spread": (tps[-1] - tps[0]) / mid, "windows": len(tps),
            "s_per_step": statistics.median(s_per_step), "peak_gib": peak_gib, **(summary or {})}  # fmt: skip


def run_row(args: argparse.Namespace) -> dict[str, float]:
    impl = args.row.split(".", 1)[1]
    compiled = not impl.endswith("_eager")
    if impl.startswith("hf_"):
        return row_hf(args, compiled)
    if impl.startswith("torchtitan_"):
        return row_torchtitan(args, compiled)
    if impl.startswith("plait_step_"):
        return row_plait_step(args, compiled)
    extra = trainer_layout(impl, args.batch, int(args.model["num_hidden_layers"]))[1]
    checkpointed = args.activation_checkpointing != "none"
    if checkpointed:
        extra.append(f"--parallel.activation_checkpointing.mode={args.activation_checkpointing}")
    if impl == "plait_trainer_no_graphs" or checkpointed:  # checkpointing: measured without CUDA graphs
        extra.append("--parallel.cuda_graphs=false")
    return row_plait_trainer(args, compiled, extra + args.trainer_args.split())


def canonical(row: str) -> str:
    """``<workload>.<implementation>``; a bare implementation is the MoE workload's."""
    return row if "." in row else f"moe.{row}"


def known(row: str) -> bool:
    """Whether ``row`` names a workload's implementation (or an n-GPU Trainer row of the MoE workload)."""
    name, _, impl = canonical(row).partition(".")
    w = WORKLOADS.get(name)
    if w is None:
        return False
    if re.fullmatch(r"(plait_step|torchtitan)_fsdp\d+", impl):
        return w.titan is not None or impl.startswith("plait")
    return impl in w.impls or (name == "moe" and trainer_layout(impl, 2)[0] > 1)


# ------------------------------------------------------------------ driver
def _spawn(row: str, args: argparse.Namespace, devices: list[int] | None = None) -> dict[str, Any]:
    common = [
        "--row",
        row,
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--windows",
        str(args.windows),
    ]
    common += ["--variants", args.variants]
    common += ["--smoke"] if args.smoke else []
    common += ["--profile"] if args.profile else []
    common += [f"--trainer-args={args.trainer_args}"] if args.trainer_args else []
    common += [
        "--model",
        args.model_name,
        "--plait-moments",
        args.plait_moments,
        "--fp8-recipe",
        args.fp8_recipe,
        "--activation-checkpointing",
        args.activation_checkpointing,
    ]
    nproc = trainer_layout(row, 4)[0]
    if nproc > 1:
        if not args.smoke and torch.cuda.device_count() < nproc:
            print(f"{row}: skipped, needs {nproc} GPUs ({torch.cuda.device_count()} present)", flush=True)
            return {"row": row, "skipped": f"needs {nproc} GPUs ({torch.cuda.device_count()} present)"}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
        cmd += ["-m", "benchmarks.training.throughput", *common]
    else:
        cmd = [sys.executable, "-m", "benchmarks.training.throughput", *common]
    t0 = time.time()
    try:
        env = None if devices is None else {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(map(str, devices))}
        proc = subprocess.run(
            cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.row_timeout, env=env
        )
    except subprocess.TimeoutExpired:
        print(f"--- {row} timed out after {args.row_timeout:.0f} s", flush=True)
        return {"row": row, "skipped": f"timed out after {args.row_timeout:.0f} s"}
    results = [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    log_dir = args.log_dir
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
        (log_dir / f"{row}{args.trainer_args.replace(' ', '_')[:60]}.log").write_text(
            proc.stdout + proc.stderr
        )
    elif args.profile:
        body = [ln for ln in proc.stdout.splitlines() if not ln.startswith("RESULT ")]
        print(f"--- {row} profile\n" + "\n".join(body), flush=True)
    if proc.returncode != 0 or not results:
        lines = (proc.stdout + proc.stderr).strip().splitlines()
        errors = [ln for ln in lines if "Error" in ln or "error:" in ln][-5:]  # torchrun's summary hides them
        tail = errors + lines[-15:]
        print(f"--- {row} failed (rc {proc.returncode}):\n" + "\n".join(tail), flush=True)
        return {"row": row, "skipped": f"failed (rc {proc.returncode}): {tail[-1] if tail else ''}"[:200]}
    res = {"row": row, **results[0], "wall_s": time.time() - t0}
    print(f"{row}: {res}", flush=True)
    return res


def spawn_rows(row: str, args: argparse.Namespace, devices: list[int] | None = None) -> list[dict[str, Any]]:
    """:func:`_spawn` (on ``devices``, default all) with a plait_step row's variants as rows of their own."""
    res = _spawn(row, args, devices)
    variants = res.pop("variants", None)
    if variants is None:
        return [res]
    return [{**res, **v, "row": row, "variant": name} for name, v in variants.items()]


def row_key(row: str) -> str:
    """The table's stable id of a row (``moe/plait-trainer-compiled``)."""
    workload, impl = canonical(row).split(".", 1)
    return row_id(workload, impl)


def _table(args: argparse.Namespace, results: list[dict[str, Any]], peak_tflops: float) -> str:
    by = {r["row"]: r for r in results}
    lines = ["| id | row | tok/s per GPU | MFU | peak GiB | vs transformers + compile | vs plait step (same mode) |",
             "|---|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in results:
        workload, impl = r["row"].split(".", 1)
        head = f"| `{row_key(r['row'])}` | {r['row']}"
        if "skipped" in r:
            lines.append(f"{head} | {r['skipped']} | | | | |")
            continue
        model, _, seq = shape(args, workload)
        tps = r["tok_s_per_gpu"]
        mfu = flops_per_token(model, seq) * tps / (peak_tflops * 1e12)
        base = by.get(f"{workload}.hf_compiled", {}).get("tok_s_per_gpu")
        mode = "eager" if impl.endswith("eager") else "compiled"
        step = by.get(f"{workload}.plait_step_{mode}", {}).get("tok_s_per_gpu")
        ratio = f"{tps / base:.2f}x" if base else ""
        fp8 = impl.startswith("plait_step_fp8")
        vs_step = f"{tps / step:.2f}x" if step and (impl.startswith("plait_trainer") or fp8) else ""
        lines.append(f"{head} | {tps / 1e3:.1f}k | {mfu:.1%} | {r['peak_gib']:.1f} | {ratio} | {vs_step} |")
    return "\n".join(lines)


def verdicts(results: list[dict[str, Any]]) -> list[str]:
    """One line per target whose rows ran (or were asked for) in this run."""
    by = {r["row"]: r for r in results}
    workloads = {r["row"].split(".", 1)[0] for r in results}
    return [t.verdict(by) for t in TARGETS if t.workload in workloads]


def shape(args: argparse.Namespace, workload: str) -> tuple[dict[str, Any], int, int]:
    """The Hugging Face config dict, batch and sequence length a workload's rows train here."""
    w = WORKLOADS[workload]
    if args.smoke:
        return {**w.hf_config, **w.smoke}, 2, 64
    if workload == "moe" and args.model_name == "gpu1":
        return {"model_type": "qwen3_moe", **tomllib.loads(GPU1_TOML.read_text())["model"]}, w.batch, w.seq
    return w.hf_config, w.batch, w.seq


def default_rows(workloads: list[str]) -> list[str]:
    """Every row of ``workloads`` (the MoE workload adds its 2-GPU Trainer rows)."""
    rows = [f"{name}.{impl}" for name in workloads for impl in WORKLOADS[name].impls]
    return rows + (ROWS_2GPU if "moe" in workloads else [])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (``argv``, default ``sys.argv``) with the device it implies; ``--row``: its model."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--rows",
        nargs="+",
        default=None,
        help="rows to run, <workload>.<implementation> (default: every row of --workloads); "
        "moe.plait_trainer_{fsdp,ep,pp}<n> for n GPUs",
    )
    ap.add_argument(
        "--workloads", nargs="+", choices=list(WORKLOADS), default=list(DEFAULT_WORKLOADS),
        help=f"workloads whose rows run when --rows is not given (default {list(DEFAULT_WORKLOADS)})",
    )  # fmt: skip
    ap.add_argument("--row", help=argparse.SUPPRESS)  # internal: run one row in this process
    ap.add_argument(
        "--plait-moments",
        choices=("float32", "bfloat16"),
        default="bfloat16",
        help="AdamW moment dtype of the plait_step rows (bfloat16: like the peers' torch AdamW on bf16 "
        "parameters; the Trainer rows take the main job's optimizer settings)",
    )
    ap.add_argument(
        "--fp8-recipe",
        choices=("tensorwise", "rowwise", "rowwise_with_gw_hp"),
        default="tensorwise",
        help="torchao float8 recipe of the plait_step_fp8 rows (ParallelConfig.float8.recipe)",
    )
    ap.add_argument(
        "--activation-checkpointing",
        choices=("none", "full", "selective"),
        default="none",
        help="plait rows: ParallelConfig.activation_checkpointing.mode (every decoder layer; the Trainer rows "
        "then without CUDA graphs)",
    )
    ap.add_argument("--steps", type=int, default=20, help="steps per timed window")
    ap.add_argument("--windows", type=int, default=1, help="timed windows per row (median and spread)")
    ap.add_argument(
        "--variants",
        default='{"": {}}',
        help="plait_step rows: JSON {name: ParallelConfig overrides}, each built and timed in turn in one "
        'process (e.g. \'{"": {}, "reshard": {"reshard_after_forward": true}}\')',
    )
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--row-timeout", type=float, default=900)
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU, 2 steps (checks the script)")
    ap.add_argument("--log-dir", type=Path, help="write each row's whole output (its profile tables) here")
    ap.add_argument("--no-write", action="store_true", help="do not write benchmarks/results/training.md")
    ap.add_argument(
        "--check",
        action="store_true",
        help=f"run each row {CHECK_RUNS} times; exit 1 naming rows > 5%% slower than results/training.md",
    )
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
        help="the MoE workload's model: the 1.14B benchmark model, or the main job's (configs/gpu1.toml's [model])",
    )
    args = ap.parse_args(argv)
    if args.rows is not None:
        if bad := [r for r in args.rows if not known(r)]:
            ap.error(f"--rows: unknown {bad}; known: {default_rows(list(WORKLOADS))} and "
                     "moe.plait_trainer_{fsdp,ep,pp}<n> (n >= 2)")  # fmt: skip
        args.rows = [canonical(r) for r in args.rows]
    args.device = "cpu" if args.smoke or not torch.cuda.is_available() else "cuda"
    if args.row:
        args.row = canonical(args.row)
        args.workload = WORKLOADS[args.row.split(".", 1)[0]]
    if args.smoke:
        args.steps, args.warmup = 2, 1
    # The row's workload's shapes (the parent process: the MoE workload's, which scaling.py reads).
    args.model, args.batch, args.seq = shape(args, args.workload.name if args.row else "moe")
    return args


def measure(args: argparse.Namespace, rows: list[str]) -> tuple[list[dict[str, Any]], float, float, str]:
    """Run ``rows`` (one process or torchrun each): results, bf16 TFLOP/s, FLOPs per token of
    ``args.model``, environment."""
    peak = bf16_matmul_tflops() if args.device == "cuda" else float("nan")
    fpt = flops_per_token(args.model, args.seq)
    dev = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (smoke)"
    import triton

    env = (f"{dev}, torch {torch.__version__}, triton {triton.__version__}, "
           f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC")  # fmt: skip
    print(f"{env}; bf16 matmul {peak:.0f} TFLOP/s", flush=True)
    return [res for r in rows for res in spawn_rows(r, args)], peak, fpt, env


def check(args: argparse.Namespace, rows: list[str]) -> int:
    """Run ``rows`` ``CHECK_RUNS`` times; compare each row's median tok/s with the committed table."""
    text = RESULTS.read_text()
    committed = parse_table(text, "tok/s per GPU")
    if args.device == "cuda" and (warning := device_mismatch(text, torch.cuda.get_device_name())):
        print(warning, flush=True)
    runs = []
    for _ in range(CHECK_RUNS):
        results = measure(args, rows)[0]
        runs.append({row_key(r["row"]): r["tok_s_per_gpu"] for r in results if "skipped" not in r})
    measured = median_rows(runs)
    compared = sum(rid in committed for rid in measured)
    return report(regressions(committed, measured, higher_is_better=True), compared, RESULTS.name)


def main() -> None:
    args = parse_args()
    if args.row:
        if args.device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        res = run_row(args)
        if int(os.environ.get("RANK", "0")) == 0:
            print("RESULT " + json.dumps(res), flush=True)
        return

    rows = args.rows or default_rows(args.workloads)
    if args.check:
        sys.exit(check(args, rows))
    results, peak, _, env = measure(args, rows)
    table = _table(args, results, peak)
    lines = verdicts(results)
    print(table)
    print("\n".join(lines))
    if not args.no_write and not args.smoke and args.model_name == "benchmark":
        titles = "; ".join(
            f"`{w}`: {WORKLOADS[w].title}" for w in dict.fromkeys(r.split(".")[0] for r in rows)
        )
        RESULTS.write_text(
            "# Training throughput: plait vs transformers and torchtitan\n\n"
            f"**device:** {env}\n\n**command:** `python3 -m benchmarks.training.throughput "
            f"{' '.join(sys.argv[1:])}`\n\n"
            f"bf16 matmul rate measured in the same run: {peak:.0f} TFLOP/s (MFU denominator). Workloads: {titles}; "
            f"bf16 parameters (float8 rows: torchao {args.fp8_recipe} float8 linears); {args.warmup} warm-up steps, {args.steps} timed; one process per row.\n\n"
            f"{table}\n\n" + "\n".join(f"- {v}" for v in lines) + "\n"
        )


if __name__ == "__main__":
    main()
