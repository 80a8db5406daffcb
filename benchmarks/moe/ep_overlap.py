"""Expert parallelism with the all-to-alls overlapped: chunked dispatch pipelined with the expert GEMMs.

Run with torchrun (one process per GPU):

    torchrun --standalone --nproc-per-node 2 benchmarks/moe/ep_overlap.py \\
        [--markdown benchmarks/results/moe_ep_overlap.md] [--profile DIR]

The MoE layer of the main GPU model (hidden 1024, 64 experts top-8, expert FFN 512, bf16), every
rank routing its own 8192 tokens, forward + backward. Rows, in the same run at equal tokens per
rank: no expert parallelism (every GPU holds all experts, no communication), then EP over all
ranks with ``num_chunks`` = 1 (dispatch, experts, combine in sequence) and the chunked pipelines
(``--chunks``, default 2 and 4). Each EP row's output is compared with the no-EP layer's (relative L2).
``--profile DIR`` writes a torch.profiler chrome trace of rank 0 for each EP row, 3 steps
(``DIR/ep_overlap_rank0_chunks{N}.json``): with N > 1 the NCCL all-to-all kernels run concurrently
with the grouped GEMMs of the neighbouring chunk; with N = 1 they alternate.
``--smoke`` runs tiny shapes on CPU with gloo (checks the script, times nothing meaningful).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import cuda_time_ms, ensure_plait_importable, environment, markdown_table

ensure_plait_importable()
from plait.moe import AllToAllDispatcher, MoELayer, RouterConfig, expert_parallel  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=8192, help="tokens per rank")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--ffn", type=int, default=512)
    p.add_argument("--chunks", type=int, nargs="+", default=[2, 4], help="num_chunks of the chunked rows")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--markdown", type=Path, default=None)
    p.add_argument("--profile", type=Path, default=None, help="write rank 0's chrome trace here")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, CPU + gloo: checks the script runs")
    args = p.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    if args.smoke:
        args.tokens, args.hidden, args.experts, args.topk, args.ffn, args.warmup, args.iters = (
            64,
            32,
            8,
            2,
            16,
            1,
            2,
        )
        dist.init_process_group("gloo")
        dev, dtype = torch.device("cpu"), torch.float32
    else:
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
        dev, dtype = torch.device("cuda", local_rank), torch.bfloat16
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh(dev.type, (world,), mesh_dim_names=("ep",))

    def make() -> MoELayer:
        torch.manual_seed(0)  # identical weights on every rank
        layer = MoELayer(
            args.hidden, args.ffn, args.experts, RouterConfig(top_k=args.topk, norm_topk_prob=True)
        )
        return layer.to(dev, dtype)

    ep_layer = expert_parallel(make(), mesh)  # every EP row: these weights, its own dispatcher
    layers: list[tuple[str, MoELayer, int | None]] = [("no EP (all experts per GPU)", make(), None)]
    layers += [(f"EP={world}, num_chunks={c}", ep_layer, c) for c in [1, *args.chunks]]

    g = torch.Generator(device=dev).manual_seed(1 + rank)  # different tokens per rank
    x = torch.randn(args.tokens, args.hidden, device=dev, dtype=dtype, generator=g).requires_grad_()
    dy = torch.randn(args.tokens, args.hidden, device=dev, dtype=dtype, generator=g)

    def use(layer: MoELayer, num_chunks: int | None) -> MoELayer:
        if num_chunks is not None:
            layer.dispatcher = AllToAllDispatcher(mesh.get_group(), num_chunks)
        return layer

    def step(layer: MoELayer) -> None:
        x.grad = None
        for q in layer.parameters():
            q.grad = None
        layer(x).hidden_states.backward(dy)

    with torch.no_grad():
        y_ref = layers[0][1](x).hidden_states.float()
        rel = {
            name: ((use(layer, c)(x).hidden_states.float() - y_ref).norm() / y_ref.norm()).item()
            for name, layer, c in layers[1:]
        }

    results = []
    for name, layer, num_chunks in layers:
        use(layer, num_chunks)
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        dist.barrier()
        ms = cuda_time_ms(lambda layer=layer: step(layer), args.warmup, args.iters)
        mem = torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else float("nan")
        ms_t = torch.tensor([ms], device=dev)
        dist.all_reduce(ms_t, op=dist.ReduceOp.MAX)  # the slowest rank sets the step time
        results.append((name, ms_t.item(), mem))

    if args.profile is not None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if dev.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        for _, layer, num_chunks in layers[1:]:
            use(layer, num_chunks)
            with torch.profiler.profile(activities=activities) as prof:
                for _ in range(3):
                    step(layer)
                if dev.type == "cuda":
                    torch.cuda.synchronize()
            if rank == 0:
                args.profile.mkdir(parents=True, exist_ok=True)
                prof.export_chrome_trace(str(args.profile / f"ep_overlap_rank0_chunks{num_chunks}.json"))

    if rank == 0:
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
            f"FFN {args.ffn}, {str(dtype).removeprefix('torch.')}, forward + backward. Mean of {args.iters} "
            f"iterations after {args.warmup} warm-up, slowest rank.\n\n"
            f"{markdown_table(header, rows)}\n"
        )
        print(text)
        if args.markdown is not None:
            args.markdown.parent.mkdir(parents=True, exist_ok=True)
            args.markdown.write_text(text)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
