"""Expert parallelism with the all-to-alls overlapped: chunked dispatch pipelined with the expert GEMMs.

Run with torchrun (one process per GPU):

    torchrun --standalone --nproc-per-node 2 -m benchmarks.moe.ep_overlap \\
        [--markdown benchmarks/results/moe_ep_overlap.md] [--profile DIR] [--compile [--inductor-overlap]]

The MoE layer of the main GPU model (hidden 1024, 64 experts top-8, expert FFN 512, bf16), every
rank routing its own 8192 tokens, forward + backward. Rows, in the same run at equal tokens per
rank: no expert parallelism (every GPU holds all experts, no communication), then EP over all
ranks with ``num_chunks`` = 1 (dispatch, experts, combine in sequence), the chunked pipelines
(``--chunks``, default 2 and 4) and the all-gather dispatch (tokens all-gathered, outputs reduce-scattered, no host sync)
with 1 and ``--chunks`` chunks. Each EP row's output is compared with the no-EP layer's (relative L2).
``--compile`` compiles the layer of each row (``torch.compile``; the all-to-all rows are left out: their
host reads break the graph); ``--inductor-overlap`` also turns on Inductor's reordering of collectives
and their waits (``reorder_for_compute_comm_overlap`` with ``sink_waits`` and ``raise_comms``).
``--profile DIR`` writes a torch.profiler chrome trace of rank 0 for each EP row, 3 steps
(``DIR/ep_overlap_rank0_chunks{N}.json``, ``..._all_gather.json``): with N > 1 the NCCL all-to-all kernels run concurrently
with the grouped GEMMs of the neighbouring chunk; with N = 1 they alternate.
``--smoke`` runs tiny shapes on CPU with gloo (checks the script, times nothing meaningful).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from plait.moe import AllGatherDispatcher, AllToAllDispatcher, MoELayer, expert_parallel

from benchmarks.moe._common import EPBench, environment, ep_parser, markdown_table


def main() -> None:
    p = ep_parser(__doc__, tokens=8192, hidden=1024, experts=64, ffn=512)
    p.add_argument("--chunks", type=int, nargs="+", default=[2, 4], help="num_chunks of the chunked rows")
    p.add_argument("--profile", type=Path, default=None, help="write rank 0's chrome trace here")
    p.add_argument("--compile", action="store_true", help="compile each row's layer (all-gather rows only)")
    p.add_argument("--inductor-overlap", action="store_true", help="with --compile: Inductor comm reordering")
    args = p.parse_args()
    if args.inductor_overlap:
        torch._inductor.config.reorder_for_compute_comm_overlap = True
        torch._inductor.config.reorder_for_compute_comm_overlap_passes = ["sink_waits", "raise_comms"]
    b = EPBench.start(args)
    dev, dtype, world = b.dev, b.dtype, b.world
    ep_layer = expert_parallel(b.make_layer(), b.mesh)  # every EP row: these weights, its own dispatcher
    group = b.mesh.get_group()
    layers: list[tuple[str, MoELayer, AllToAllDispatcher | AllGatherDispatcher | None]] = [
        ("no EP (all experts per GPU)", b.make_layer(), None)
    ]
    if not args.compile:
        layers += [
            (f"EP={world}, num_chunks={c}", ep_layer, AllToAllDispatcher(group, c)) for c in [1, *args.chunks]
        ]
    layers += [
        (f"EP={world}, all-gather, num_chunks={c} (no host sync)", ep_layer, AllGatherDispatcher(group, c))
        for c in [1, *args.chunks]
    ]

    def use(layer: MoELayer, dispatcher: AllToAllDispatcher | AllGatherDispatcher | None) -> Any:
        if dispatcher is not None:
            layer.dispatcher = dispatcher
        if args.compile:
            torch._dynamo.reset()  # one compiled layer per row
            return torch.compile(layer)
        return layer

    y_ref = layers[0][1](b.x).hidden_states.detach().float()
    rel, results = {}, []
    for name, layer, dispatcher in layers:  # one row at a time: the EP rows share one layer
        run = use(layer, dispatcher)
        if dispatcher is not None:
            rel[name] = ((run(b.x).hidden_states.detach().float() - y_ref).norm() / y_ref.norm()).item()
        results.append((name, *b.time(run)))

    if args.profile is not None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if dev.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        for _, layer, dispatcher in layers[1:]:
            run = use(layer, dispatcher)
            for _ in range(2):  # compile / warm up outside the window
                b.step(run)
            with torch.profiler.profile(activities=activities) as prof:
                for _ in range(3):
                    b.step(run)
                if dev.type == "cuda":
                    torch.cuda.synchronize()
            if b.rank == 0:
                args.profile.mkdir(parents=True, exist_ok=True)
                assert dispatcher is not None
                kind = "all_gather_" if isinstance(dispatcher, AllGatherDispatcher) else ""
                label = f"{kind}chunks{dispatcher.num_chunks}{'_compiled' if args.compile else ''}"
                prof.export_chrome_trace(str(args.profile / f"ep_overlap_rank0_{label}.json"))

    base = results[0][1]
    rows = [
        [
            name,
            f"{ms:.2f}",
            f"{args.tokens / (ms * 1e-3) / 1e3:.0f}",
            f"{base / ms:.2f}x",
            "" if name not in rel else f"{rel[name]:.1e}",
            f"{mem:.1f}",
        ]
        for name, ms, mem in results
    ]
    env = environment()
    header = [
        "layout",
        "fwd+bwd ms",
        "k tok/s per rank",
        "vs no EP",
        "output rel. L2 vs no EP",
        "peak mem GiB",
    ]
    text = (
        f"# MoE layer, expert parallel over {world} GPUs: all-to-alls overlapped with the experts\n\n"
        f"{world} x {env['device']}; torch {env['torch']}, triton {env['triton']}; {env['date']}\n\n"
        f"Per rank: {args.tokens} tokens, hidden {args.hidden}, {args.experts} experts, top-{args.topk}, "
        f"FFN {args.ffn}, {str(dtype).removeprefix('torch.')}, forward + backward"
        f"{', compiled' if args.compile else ''}{' (Inductor comm reordering)' if args.inductor_overlap else ''}. Mean of {args.iters} "
        f"iterations after {args.warmup} warm-up, slowest rank.\n\n"
        f"{markdown_table(header, rows)}\n"
    )
    b.finish(text)


if __name__ == "__main__":
    main()
