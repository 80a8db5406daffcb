"""Long-context training with context parallelism: the longest sequence and tok/s per GPU, cp=1 vs cp=2.

Run on two GPUs (one command):

    torchrun --standalone --nproc-per-node 2 -m benchmarks.context.long_context \
        [--mode allgather|ring] [--markdown benchmarks/results/long_context.md]

Model: the main job's one-GPU Qwen3-MoE (``examples/qwen3_moe/configs/gpu1.toml``, bf16 parameters,
AdamW), one sequence per step, built and parallelised with the model + plan API only
(``Qwen3ForCausalLM`` + ``parallelize``; no training loop). In the same run:

1. cp=1: rank 0 alone (no process group in the model) finds the longest sequence for which a
   training step (forward, backward, optimizer step) fits, by doubling then bisection on multiples of
   ``--granularity``; and times steps at ``--base-seq`` (16k) and ``--seq`` (32k, if it fits).
2. cp=2: both ranks, ``DeviceMeshParameters(context_shard=2)`` (FSDP2 over ``dp_cp_shard`` + context
   parallel attention), the same search and the same timings (the sequence sharded with
   ``plait.dist_core.shard_batch``).

Printed: the longest trainable sequence of each and their ratio (target >= 1.9x), tok/s per GPU at
``--seq`` with cp=2 against cp=1 at ``--base-seq`` (target >= 0.85x) and against cp=1 at ``--seq``,
and the model FLOP utilisation against the measured bf16 matmul rate.

``--search {both,cp1,cp2,none}`` picks the layouts that search (``none``: throughput only);
``--search-only`` prints the longest sequences and times nothing; ``--fits-at N`` starts the bisection
from a length known to fit (with ``--search-from`` and ``--max-seq`` around a known bound: a few trials).

A cp=2 trial that runs out of memory on one rank but not the other can leave the other waiting
in a collective: the process group times out after ``--timeout`` seconds and the run ends with that
error; rerun with ``--max-seq`` below the length it reached. ``--profile`` prints, after the timings, a
torch.profiler table of 3 steps at ``--seq`` for cp=1 and for cp=2 (rank 0; where the cp=2 step's time
goes; with ``PROFILE_TRACE_DIR`` set, also every rank's timeline).

``--compile`` compiles every decoder layer (both layouts); ``--flex-row`` adds a cp=2 row with
``attn_implementation="flex"`` (the block-mask kernel; plain causal rows otherwise run cuDNN per
chunk). ``--smoke`` runs a tiny model on CPU (gloo) to check the script.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import time
import tomllib
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from plait.dist_core import DeviceMeshParameters, DistributedContext, shard_batch
from plait.models import ParallelConfig, flops_per_token, parallelize
from plait.models.qwen3 import Qwen3ForCausalLM, Qwen3MoeConfig

from benchmarks.moe._common import bf16_matmul_tflops, environment, markdown_table

ROOT = Path(__file__).resolve().parents[2]
SMOKE_MODEL = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    moe_intermediate_size=16,
    num_experts=4,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    router_aux_loss_coef=0.001,
)


def model_config(args: argparse.Namespace) -> Qwen3MoeConfig:
    if args.smoke:
        fields: dict[str, Any] = dict(SMOKE_MODEL)
    else:
        fields = tomllib.loads(args.config.read_text())["model"]
    fields["max_position_embeddings"] = max(int(fields.get("max_position_embeddings", 0)), args.max_seq)
    return Qwen3MoeConfig(**fields)


class Trainer:
    """One model (cp=1 on this rank alone, or cp=2 over the world), its optimizer and a train step."""

    def __init__(self, cfg: Qwen3MoeConfig, args: argparse.Namespace, device: torch.device, ctx: Any) -> None:
        self.cfg, self.args, self.device, self.ctx = cfg, args, device, ctx
        with torch.device("meta"):
            model = Qwen3ForCausalLM(cfg)
        model.to(args.dtype)
        # cp=1 (no context): the plan applies only the compile, if asked.
        parallelize(
            model,
            context=ctx,
            config=ParallelConfig(context_parallel_attention=args.mode, compile=args.compile),
        )
        if ctx is not None:
            cp = ctx.mesh_for("batch")["cp"]
            self.cp_size, self.cp_rank = cp.size(), cp.get_local_rank()
        else:
            self.cp_size, self.cp_rank = 1, 0
        model.to_empty(device=device)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model.reset_parameters()
        self.model = model.train()
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def step(self, seq: int) -> None:
        g = torch.Generator().manual_seed(seq)
        full = {
            "input_ids": torch.randint(0, self.cfg.vocab_size, (1, seq), generator=g),
            "labels": torch.randint(0, self.cfg.vocab_size, (1, seq), generator=g),
        }
        batch = {k: v.to(self.device) for k, v in shard_batch(full, self.cp_size, self.cp_rank).items()}
        out = self.model(**batch)
        (out["loss_sum"] / seq + out["aux_loss"] * batch["labels"].numel() / seq).backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def fits(self, seq: int) -> bool:
        """Whether a training step at ``seq`` tokens fits on every rank of this trainer."""
        ok = True
        try:
            self.step(seq)
        except torch.OutOfMemoryError:
            ok = False
        self.opt.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        if self.ctx is not None:
            flag = torch.tensor([float(ok)], device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            ok = bool(flag.item())
        if self.cp_rank == 0:
            print(f"cp={self.cp_size} seq {seq}: {'fits' if ok else 'out of memory'}", flush=True)
        return ok

    def longest(self) -> int:
        """Doubling from ``--search-from`` (default ``--granularity``) up to ``--max-seq``, then bisection to ``--granularity``."""
        gran, top = self.args.granularity, self.args.max_seq
        good, bad, seq = self.args.fits_at, top + gran, self.args.search_from or gran
        while seq <= top:
            if not self.fits(seq):
                bad = seq
                break
            good, seq = seq, seq * 2
        while bad - good > gran:
            mid = (good + bad) // 2 // gran * gran
            if self.fits(mid):
                good = mid
            else:
                bad = mid
        return good

    def tok_per_s_per_gpu(self, seq: int) -> tuple[float, float]:
        """(tok/s per GPU, peak GiB) of training steps at ``seq`` tokens; NaN if it does not fit."""
        if not self.fits(seq):
            return math.nan, math.nan
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        for _ in range(self.args.warmup):
            self.step(seq)
        self._sync()
        t0 = time.perf_counter()
        for _ in range(self.args.iters):
            self.step(seq)
        self._sync()
        dt = (time.perf_counter() - t0) / self.args.iters
        if self.ctx is not None:  # the slowest rank sets the step time
            t = torch.tensor([dt], device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            dt = t.item()
        mem = torch.cuda.max_memory_allocated() / 2**30 if self.device.type == "cuda" else math.nan
        return seq / dt / self.cp_size, mem

    def profile(self, seq: int) -> None:
        """``--profile``: a torch.profiler table of 3 training steps at ``seq`` (printed by context rank 0)."""
        from torch.profiler import ProfilerActivity, profile

        cuda = self.device.type == "cuda"
        with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]) as prof:
            for _ in range(3):
                self.step(seq)
            self._sync()
        if trace_dir := os.environ.get("PROFILE_TRACE_DIR"):  # every rank's timeline (chrome://tracing)
            prof.export_chrome_trace(f"{trace_dir}/trace_cp{self.cp_size}_{seq}_rank{self.cp_rank}.json.gz")
        if self.cp_rank == 0:
            key = "self_device_time_total" if cuda else "self_cpu_time_total"
            print(f"--- profile: cp={self.cp_size}, seq {seq}, 3 steps", flush=True)
            print(prof.key_averages().table(sort_by=key, row_limit=25), flush=True)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()


def search_only(cfg: Any, args: argparse.Namespace, device: torch.device, rank: int, host: Any) -> None:
    """``--search-only``: the longest sequence of the layouts ``--search`` names, printed; no throughput."""
    if args.search in ("both", "cp1") and rank == 0:
        print(f"Longest cp=1: {Trainer(cfg, args, device, None).longest()}", flush=True)
    dist.barrier(group=host)
    if args.search in ("both", "cp2"):
        ctx = DistributedContext.from_env(DeviceMeshParameters(context_shard=2), device=device)
        longest = Trainer(cfg, args, device, ctx).longest()
        if rank == 0:
            print(f"Longest cp=2 ({args.mode}): {longest}", flush=True)
        ctx.shutdown()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, default=ROOT / "examples/qwen3_moe/configs/gpu1.toml")
    p.add_argument("--mode", choices=["allgather", "ring"], default="allgather")
    p.add_argument("--seq", type=int, default=32768, help="sequence length of the cp=2 throughput")
    p.add_argument("--base-seq", type=int, default=16384, help="sequence length of the cp=1 baseline")
    p.add_argument("--granularity", type=int, default=4096, help="search step (a multiple of 4)")
    p.add_argument("--max-seq", type=int, default=1 << 20, help="upper end of the search")
    p.add_argument(
        "--search-from", type=int, default=None, help="first length of the search (default --granularity)"
    )
    p.add_argument(
        "--search",
        choices=["both", "cp1", "cp2", "none"],
        default="both",
        help="which layouts search for their longest sequence (none: throughput only)",
    )
    p.add_argument("--fits-at", type=int, default=0, help="a length known to fit (the bisection's lower end)")
    p.add_argument("--search-only", action="store_true", help="print the longest sequence(s); no throughput")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--timeout", type=float, default=900.0, help="collective timeout (seconds)")
    p.add_argument("--markdown", type=Path, default=None)
    p.add_argument(
        "--profile", action="store_true", help="after the timings: kernel table of 3 steps at --seq"
    )
    p.add_argument("--compile", action="store_true", help="torch.compile each decoder layer (every layout)")
    p.add_argument(
        "--flex-row",
        action="store_true",
        help="also time cp=2 with attn_implementation='flex' (the all-gather mode's FlexAttention kernel)",
    )
    p.add_argument("--smoke", action="store_true", help="tiny model on CPU + gloo: checks the script runs")
    args = p.parse_args()
    if args.smoke:
        args.seq, args.base_seq, args.granularity, args.max_seq = 128, 64, 16, 256
        args.warmup, args.iters = 1, 1
    args.dtype = torch.float32 if args.smoke else torch.bfloat16

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if args.smoke:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    else:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, timeout=datetime.timedelta(seconds=args.timeout))
    if dist.get_world_size() != 2:
        raise SystemExit(f"run with 2 processes (torchrun --nproc-per-node 2), got {dist.get_world_size()}")
    rank = dist.get_rank()
    host = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=24 * 3600))
    cfg = model_config(args)

    # 1. cp=1 on rank 0 alone; rank 1 waits on a CPU barrier with a long timeout.
    if args.search_only:
        search_only(cfg, args, device, rank, host)
        return
    cp1: dict[str, Any] = {}
    if rank == 0:
        t = Trainer(cfg, args, device, None)
        cp1 = {
            "longest": t.longest() if args.search in ("both", "cp1") else 0,
            "base": t.tok_per_s_per_gpu(args.base_seq),
            "seq": t.tok_per_s_per_gpu(args.seq),
        }
        if args.profile:
            t.profile(args.seq)
        del t
        if device.type == "cuda":
            torch.cuda.empty_cache()
    dist.barrier(group=host)

    # 2. cp=2 over both ranks.
    ctx = DistributedContext.from_env(DeviceMeshParameters(context_shard=2), device=device)
    t = Trainer(cfg, args, device, ctx)
    cp2 = {
        "longest": t.longest() if args.search in ("both", "cp2") else 0,
        "seq": t.tok_per_s_per_gpu(args.seq),
    }
    if args.profile:
        t.profile(args.seq)
    del t
    flex: tuple[float, float] | None = None
    if args.flex_row:
        flex = Trainer(
            cfg.model_copy(update={"attn_implementation": "flex"}), args, device, ctx
        ).tok_per_s_per_gpu(args.seq)
    peak = bf16_matmul_tflops()

    if rank == 0:
        env = environment()

        def mfu(tok_s: float, seq: int) -> str:
            return "n/a" if math.isnan(peak) else f"{tok_s * flops_per_token(cfg, seq) / 1e12 / peak:.0%}"

        rows = [
            ["cp=1, 1 GPU", f"{cp1['longest'] or 'not searched'}", f"{args.base_seq}", f"{cp1['base'][0]:.0f}", mfu(cp1["base"][0], args.base_seq), "1.00x", f"{cp1['base'][1]:.1f}"],
            ["cp=1, 1 GPU", "", f"{args.seq}", f"{cp1['seq'][0]:.0f}", mfu(cp1["seq"][0], args.seq), f"{cp1['seq'][0] / cp1['base'][0]:.2f}x", f"{cp1['seq'][1]:.1f}"],
            [f"cp=2 ({args.mode}), 2 GPUs", f"{cp2['longest'] or 'not searched'}", f"{args.seq}", f"{cp2['seq'][0]:.0f}", mfu(cp2["seq"][0], args.seq), f"{cp2['seq'][0] / cp1['base'][0]:.2f}x", f"{cp2['seq'][1]:.1f}"],
        ]  # fmt: skip
        if flex is not None:
            rows.append([f"cp=2 ({args.mode}, flex), 2 GPUs", "", f"{args.seq}", f"{flex[0]:.0f}", mfu(flex[0], args.seq), f"{flex[0] / cp1['base'][0]:.2f}x", f"{flex[1]:.1f}"])  # fmt: skip
        header = [
            "layout",
            "longest seq",
            "seq",
            "tok/s per GPU",
            "MFU (bf16 mm)",
            "vs cp=1 @ base",
            "peak GiB",
        ]
        ratio = (
            f"{cp2['longest'] / cp1['longest']:.2f}x" if cp1["longest"] and cp2["longest"] else "not searched"
        )
        text = (
            "# Long context: context parallelism (cp=2) vs one GPU (cp=1)\n\n"
            f"{env['device']}; torch {env['torch']}, triton {env['triton']}; {env['date']}\n\n"
            f"Model {args.config.name if not args.smoke else 'smoke'} ({cfg.num_hidden_layers} layers, hidden "
            f"{cfg.hidden_size}, {cfg.num_experts} experts top-{cfg.num_experts_per_tok}), "
            f"{str(args.dtype).removeprefix('torch.')} parameters, AdamW, one sequence per step, no activation "
            f"checkpointing, decoder layers {'compiled' if args.compile else 'eager'}; cp=2 = FSDP2 over "
            f"dp_cp_shard + `{args.mode}` attention (attn_implementation {cfg.attn_implementation!r}). Longest sequence: "
            f"search step {args.granularity}, up to {args.max_seq}. Throughput: mean of {args.iters} steps "
            f"after {args.warmup}, slowest rank. bf16 matmul peak {peak:.0f} TFLOP/s.\n\n"
            f"{markdown_table(header, rows)}\n\n"
            f"Longest sequence cp=2 / cp=1: {ratio} (target >= 1.9x). tok/s per GPU, cp=2 @ {args.seq} "
            f"vs cp=1 @ {args.base_seq}: {cp2['seq'][0] / cp1['base'][0]:.2f}x (target >= 0.85x).\n"
        )
        print(text)
        if args.markdown is not None:
            args.markdown.parent.mkdir(parents=True, exist_ok=True)
            args.markdown.write_text(text)
    ctx.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
