"""Pipeline schedules on 2 or more GPUs: plait vs torch.distributed.pipelining, simulated vs measured bubble.

Run (one command; one pipeline rank per GPU, pp = the number of processes):

    torchrun --nproc-per-node 2 -m benchmarks.pipelining.schedules
    torchrun --nproc-per-node 4 -m benchmarks.pipelining.schedules --batch 32 --seq 2048 --microbatches 8

Simulator only (no GPU, no process group): DualPipeV's greedy order vs DeepSeek's reference order, bubble and
peak activations, on unit costs and, with ``--stage-costs``, on per-stage costs measured earlier:

    python -m benchmarks.pipelining.schedules --simulate-only

A bf16 transformer (pre-norm encoder layers) is split into pipeline stages. For every schedule this script
times a full training step (forward + backward of all microbatches) with plait's executor and with
torch.distributed.pipelining's matching schedule in the same run. It also measures each stage's forward,
full backward, input-backward and weight-backward times (the first stage with its embedding, the last with
its head and loss) and the activation transfer time, feeds them to plait's simulator, and prints the
predicted bubble next to the measured one (1 - compute time of all ranks / (ranks x measured step)).
Rows are schedule kinds, plus ``dualpipev_reference`` (DualPipeV in DeepSeek's reference order; the greedy
order is the ``dualpipev`` row); both are timed against torch's ``ScheduleDualPipeV``. Prints a markdown table
on rank 0, with each schedule's peak GPU memory under plait (max over ranks).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.distributed.pipelining as tpp
import torch.nn.functional as F
from plait.pipelining import (
    ActionCosts,
    Chunk,
    PipelineState,
    Stack,
    backward_input,
    backward_weight,
    build_dualpipev,
    build_pipeline,
    build_program,
    lower,
    parse_schedule_config,
    simulate,
)
from torch import nn

DEVICE = torch.device("cpu")
TORCH_SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "looped_bfs": "ScheduleLoopedBFS",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "zb1p": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}
# Rows that are not a schedule kind: their config (the rest of the rows: {"kind": row}).
VARIANTS = {"dualpipev_reference": {"kind": "dualpipev", "order": "reference"}}


class Stage(nn.Module):
    def __init__(self, index: int, num_stages: int, layers: int, a: argparse.Namespace) -> None:
        super().__init__()
        self.first, self.last = index == 0, index == num_stages - 1
        self.embed = nn.Embedding(a.vocab, a.hidden) if self.first else None
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(
                a.hidden, a.heads, 4 * a.hidden, dropout=0.0, batch_first=True, norm_first=True
            )
            for _ in range(layers)
        )
        self.head = nn.Linear(a.hidden, a.vocab, bias=False) if self.last else None

    def forward(
        self, input_ids: torch.Tensor | None = None, h: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        if self.embed is not None:
            h = self.embed(input_ids)
        assert h is not None
        for layer in self.layers:
            h = layer(h, is_causal=False)
        if self.head is not None:
            return {"logits": self.head(h)}
        return {"h": h}


class TorchAdapter(nn.Module):
    def __init__(self, stage: Stage) -> None:
        super().__init__()
        self.stage = stage

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.stage(input_ids=x) if self.stage.first else self.stage(h=x)
        return out["logits"] if "logits" in out else out["h"]


def ce(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


def plait_loss(out: dict[str, torch.Tensor], mb) -> torch.Tensor:  # type: ignore[no-untyped-def]
    return ce(out["logits"], mb["labels"])


def make_stages(held, num_stages, a, dev):  # type: ignore[no-untyped-def]
    per = a.layers // num_stages
    torch.manual_seed(0)
    return {s: Stage(s, num_stages, per, a).to(dev, torch.bfloat16) for s in held}


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, steps: int, warmup: int) -> float:  # type: ignore[no-untyped-def]
    for _ in range(warmup):
        fn()
    sync()
    dist.barrier()
    times = []
    for _ in range(steps):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    t_ = torch.tensor([statistics.median(times)], device=DEVICE)
    dist.all_reduce(t_, op=dist.ReduceOp.MAX)
    return t_.item()


def _ev(fn) -> float:  # type: ignore[no-untyped-def]
    for _ in range(3):
        fn()
    sync()
    t = time.perf_counter()
    for _ in range(10):
        fn()
    sync()
    return (time.perf_counter() - t) / 10


def transfer_time(a: argparse.Namespace, dev: torch.device) -> float:
    """One microbatch's activations sent to the next rank while the previous one's arrive (a ring: with 2
    ranks, both directions between them at once)."""
    buf = torch.empty(a.batch // a.microbatches, a.seq, a.hidden, device=dev, dtype=torch.bfloat16)
    rank, world = dist.get_rank(), dist.get_world_size()
    nxt, prev = (rank + 1) % world, (rank - 1) % world

    def xfer() -> None:
        ops = [dist.P2POp(dist.isend, buf, nxt), dist.P2POp(dist.irecv, torch.empty_like(buf), prev)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()

    return _ev(xfer)


def measure_stages(stages, a, dev, ids, labels) -> dict[int, ActionCosts]:  # type: ignore[no-untyped-def]
    """F, B, I, W (seconds) of each stage this rank holds, on one microbatch; gathered from every rank."""
    mbs = a.batch // a.microbatches
    mine = {}
    for s, st in stages.items():
        x = (
            {"input_ids": ids[:mbs]}
            if st.first
            else {
                "h": torch.randn(mbs, a.seq, a.hidden, device=dev, dtype=torch.bfloat16, requires_grad=True)
            }
        )
        inputs = [] if st.first else [x["h"]]
        params = list(st.parameters())

        def fwd(st=st, x=x):  # type: ignore[no-untyped-def]
            out = st(**x)
            if st.last:
                return [ce(out["logits"], labels[:mbs])], [None]
            return [out["h"]], [torch.ones_like(out["h"])]

        f = _ev(fwd)
        fb = _ev(lambda: torch.autograd.backward(*fwd()))
        fi = _ev(lambda: backward_input(*fwd(), inputs, params))  # noqa: B023
        fiw = _ev(lambda: backward_weight(backward_input(*fwd(), inputs, params)[1]))  # noqa: B023
        st.zero_grad(set_to_none=True)
        mine[s] = (f, fb - f, fi - f, fiw - fi)
    everyone: list[dict[int, tuple[float, ...]]] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(everyone, mine)
    return {
        s: ActionCosts(forward=c[0], backward=c[1], backward_input=c[2], backward_weight=c[3])
        for per in everyone
        for s, c in per.items()
    }


def matmul_peak(dev: torch.device) -> float:
    n = 8192 if dev.type == "cuda" else 256
    x = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    for _ in range(3):
        x @ x
    sync()
    t = time.perf_counter()
    for _ in range(20):
        x @ x
    sync()
    return 20 * 2 * n**3 / (time.perf_counter() - t)


def bench_one(row, a, pp, rank, dev, ids, labels, comm, peak, step_flops):  # type: ignore[no-untyped-def]
    """Time one schedule with plait and with torch; simulate it with each stage's measured costs."""
    m = a.microbatches
    base = VARIANTS.get(row, {"kind": row})
    kind = base["kind"]
    spr = {"looped_bfs": 2, "interleaved_1f1b": 2, "zb1p": 2}.get(kind)
    cfg_d = base | {"num_microbatches": m} | ({"stages_per_rank": spr} if spr else {})
    cfg = parse_schedule_config(cfg_d)
    topo = cfg.topology(pp)
    held = topo.stages_of(rank)
    # plait
    stages = make_stages(held, topo.num_stages, a, dev)
    ex = build_pipeline(cfg, pp_group=dist.group.WORLD, stage_modules=stages, loss_fn=plait_loss)
    state = PipelineState(m, specs={"labels": Chunk(0), "loss": Stack()})

    def plait_step() -> None:
        state.reset()
        state.global_view["labels"] = labels
        ex.step({"input_ids": ids}, state)
        for s in stages.values():
            s.zero_grad(set_to_none=True)

    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    t_plait = timed(plait_step, a.steps, a.warmup)
    mem = torch.tensor(
        [torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else 0.0], device=dev
    )
    dist.all_reduce(mem, op=dist.ReduceOp.MAX)
    # torch
    tstages = {s: TorchAdapter(mod) for s, mod in make_stages(held, topo.num_stages, a, dev).items()}
    pstages = [tpp.PipelineStage(tstages[s], s, topo.num_stages, dev) for s in held]
    cls = getattr(tpp.schedules, TORCH_SCHEDULES[kind])
    multi = len(pstages) > 1 or kind in ("looped_bfs", "zb1p")
    sched = cls(pstages if multi else pstages[0], m, loss_fn=ce)

    def torch_step() -> None:
        kw = {}
        if topo.num_stages - 1 in held:
            kw["target"] = labels
        if 0 in held:
            sched.step(ids, **kw)
        else:
            sched.step(**kw)
        for s in tstages.values():
            s.zero_grad(set_to_none=True)

    t_torch = timed(torch_step, a.steps, a.warmup)
    if a.trace_dir:
        from torch.profiler import ProfilerActivity, profile

        os.makedirs(a.trace_dir, exist_ok=True)
        for name, fn in (("plait", plait_step), ("torch", torch_step)):
            dist.barrier()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                fn()
                sync()
            prof.export_chrome_trace(os.path.join(a.trace_dir, f"{row}_{name}_rank{rank}.json"))
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    # simulator with each stage's measured costs; "measured bubble" uses the same per-rank busy time
    costs = measure_stages(stages, a, dev, ids, labels)
    sim = simulate(lower(build_program(cfg, pp)), ActionCosts(comm=comm), stage_costs=costs)
    measured_bubble = max(0.0, 1 - sum(sim.busy) / (pp * t_plait))
    mfu = step_flops / t_plait / pp / peak
    if rank == 0:
        print(f"done {row}", flush=True)
    per_stage = ", ".join(
        f"{s}: {c.forward * 1e3:.1f}/{(c.backward or 0) * 1e3:.1f}/{c.backward_input * 1e3:.1f}/{c.backward_weight * 1e3:.1f}"
        for s, c in sorted(costs.items())
    )
    cells = [
        row,
        f"{t_plait * 1e3:.1f}",
        f"{t_torch * 1e3:.1f}",
        f"{t_torch / t_plait:.2f}",
        f"{sim.step_time * 1e3:.1f}",
        f"{sim.bubble_fraction:.3f}",
        f"{measured_bubble:.3f}",
        f"{mfu:.2f}",
        f"{max(sim.peak_activations):.0f}",
        f"{mem.item():.1f}",
    ]
    return cells, per_stage


def simulate_dualpipev_orders(stage_costs: str, comm_ms: float) -> None:
    """Print DualPipeV's greedy and reference orders side by side in plait's simulator (no GPU involved).

    Unit costs (F = I = W = 1) on 2, 4 and 8 ranks; with `stage_costs` (``F/B/I/W`` in ms per stage,
    comma-separated, 2 * pp stages) also those costs, e.g. the ones a 2-GPU run of this script printed.
    """
    unit = ActionCosts(forward=1.0, backward_input=1.0, backward_weight=1.0)
    cases: list[tuple[str, int, ActionCosts, dict[int, ActionCosts] | None]] = [
        ("F=I=W=1", pp, unit, None) for pp in (2, 4, 8)
    ]
    if stage_costs:
        parsed = [[float(x) for x in st.split("/")] for st in stage_costs.split(",")]
        per_stage = {
            s: ActionCosts(forward=f, backward=b, backward_input=i, backward_weight=w)
            for s, (f, b, i, w) in enumerate(parsed)
        }
        cases.append((f"measured ms, comm {comm_ms}", len(parsed) // 2, ActionCosts(comm=comm_ms), per_stage))
    print("Simulated with plait's simulator (not measured): DualPipeV greedy vs reference order.")
    print("Peak activations: stage-microbatch activations held at once, max (min) over ranks.\n")
    print(
        "| costs | pp | microbatches | step greedy | step reference | bubble greedy | bubble reference "
        "| peak act. greedy | peak act. reference |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for label, pp, costs, per in cases:
        for m in (2 * pp, 4 * pp, 8 * pp):
            res = [
                simulate(lower(build_dualpipev(pp, m, order)), costs, stage_costs=per)
                for order in ("greedy", "reference")
            ]
            peaks = [f"{max(r.peak_activations):.0f} ({min(r.peak_activations):.0f})" for r in res]
            print(
                f"| {label} | {pp} | {m} | {res[0].step_time:.1f} | {res[1].step_time:.1f} "
                f"| {res[0].bubble_fraction:.3f} | {res[1].bubble_fraction:.3f} | {peaks[0]} | {peaks[1]} |"
            )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: gloo smoke test")
    p.add_argument("--trace-dir", default="", help="also write a profiler trace of one step of each")
    p.add_argument(
        "--schedules", default="gpipe,1f1b,looped_bfs,interleaved_1f1b,zb1p,zbv,dualpipev,dualpipev_reference"
    )
    p.add_argument("--simulate-only", action="store_true", help="DualPipeV orders in the simulator; no GPU")
    p.add_argument(
        "--stage-costs", default="", help="with --simulate-only: F/B/I/W ms per stage, comma-separated"
    )
    p.add_argument("--comm-ms", type=float, default=0.0, help="with --simulate-only and --stage-costs")
    a = p.parse_args()
    if a.simulate_only:
        simulate_dualpipev_orders(a.stage_costs, a.comm_ms)
        return
    global DEVICE
    if a.device == "cuda":
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(dev)
        dist.init_process_group("nccl", device_id=dev)
    else:
        dev = torch.device("cpu")
        dist.init_process_group("gloo")
    DEVICE = dev
    rank = dist.get_rank()
    pp = dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, a.vocab, (a.batch, a.seq), generator=g).to(dev)
    labels = torch.randint(0, a.vocab, (a.batch, a.seq), generator=g).to(dev)
    m = a.microbatches
    comm = transfer_time(a, dev)
    peak = matmul_peak(dev)
    mbs = a.batch // m
    # model FLOPs per step: 6 * params * tokens for the layers (+ attention scores), head included
    layer_flops = 24 * a.hidden**2 + 4 * a.seq * a.hidden
    step_flops = 3 * a.batch * a.seq * (a.layers * layer_flops + 2 * a.hidden * a.vocab)
    rows = []
    for row in a.schedules.split(","):
        rows.append(bench_one(row, a, pp, rank, dev, ids, labels, comm, peak, step_flops))
    if rank == 0:
        print(
            f"\n{torch.cuda.get_device_name() if dev.type == 'cuda' else 'CPU (gloo)'} x{pp}, torch {torch.__version__}, bf16 matmul peak {peak / 1e12:.0f} TFLOP/s"
        )
        print(
            f"hidden {a.hidden}, layers {a.layers}, seq {a.seq}, batch {a.batch}, microbatches {m} (mbs {mbs}); "
            f"activation transfer {comm * 1e3:.2f} ms; per-stage costs below\n"
        )
        print(
            "| schedule | plait step (ms) | torch step (ms) | torch/plait | simulated step (ms) | simulated bubble "
            "| measured bubble | model FLOP/s / matmul peak | simulated peak activations (stage-mb) "
            "| plait peak memory (GiB) |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|")
        for cells, _ in rows:
            print("| " + " | ".join(cells) + " |")
        print("\nPer-stage costs (ms, one microbatch) F/B/I/W:")
        for cells, per_stage in rows:
            print(f"- {cells[0]}: {per_stage}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
