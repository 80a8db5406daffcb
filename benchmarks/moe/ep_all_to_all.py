"""Expert-parallel MoE layer (all-to-all dispatch, EP=2) forward+backward throughput on 2 GPUs.

Run with torchrun (one process per GPU):

    torchrun --standalone --nproc-per-node 2 benchmarks/moe/ep_all_to_all.py [--markdown benchmarks/results/moe_ep_all_to_all.md]

Every rank routes its own ``--tokens`` tokens. Compared in the same run: the same layer without
expert parallelism (every GPU holds all experts, no communication), and the raw NCCL
``all_to_all_single`` rate for the bytes one dispatch moves (the communication ceiling). Outputs of
the two layouts are checked against each other.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import bf16_matmul_tflops, cuda_time_ms, ensure_plait_importable, environment, markdown_table

ensure_plait_importable()
from plait.moe import MoELayer, RouterConfig, expert_parallel  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=16384, help="tokens per rank")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--ffn", type=int, default=768)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--markdown", type=Path, default=None)
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
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(dev.type, (world,), mesh_dim_names=("ep",))

    def make() -> MoELayer:
        torch.manual_seed(0)  # identical weights on every rank
        layer = MoELayer(
            args.hidden, args.ffn, args.experts, RouterConfig(top_k=args.topk, norm_topk_prob=True)
        )
        return layer.to(dev, dtype)

    local_layer = make()
    ep_layer = expert_parallel(make(), mesh)

    g = torch.Generator(device=dev).manual_seed(1 + rank)  # different tokens per rank
    x = torch.randn(args.tokens, args.hidden, device=dev, dtype=dtype, generator=g).requires_grad_()
    dy = torch.randn(args.tokens, args.hidden, device=dev, dtype=dtype, generator=g)

    def step(layer: MoELayer) -> None:
        x.grad = None
        for q in layer.parameters():
            q.grad = None
        layer(x).hidden_states.backward(dy)

    with torch.no_grad():
        y_ep, y_local = ep_layer(x).hidden_states.float(), local_layer(x).hidden_states.float()
    rel = ((y_ep - y_local).norm() / y_local.norm()).item()

    results = []
    for name, layer in (
        (f"plait EP={world} all-to-all", ep_layer),
        ("plait no EP (all experts per GPU)", local_layer),
    ):
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        dist.barrier()
        ms = cuda_time_ms(lambda layer=layer: step(layer), args.warmup, args.iters)
        mem = torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else float("nan")
        ms_t = torch.tensor([ms], device=dev)
        dist.all_reduce(ms_t, op=dist.ReduceOp.MAX)  # the slowest rank sets the step time
        results.append((name, ms_t.item(), mem))

    # Communication ceiling: one dispatch's bytes (T*k rows, evenly split) through all_to_all_single.
    buf = torch.randn(args.tokens * args.topk, args.hidden, device=dev, dtype=dtype)
    out = torch.empty_like(buf)
    a2a_ms = cuda_time_ms(lambda: dist.all_to_all_single(out, buf), 3, args.iters)
    a2a_gbs = buf.numel() * buf.element_size() * (world - 1) / world / (a2a_ms * 1e-3) / 1e9
    peak = bf16_matmul_tflops()

    if rank == 0:
        t, k, h, f, e = args.tokens, args.topk, args.hidden, args.ffn, args.experts
        flops = 3 * (6 * t * k * h * f + 2 * t * h * e)  # per rank
        base = results[1][1]
        rows = []
        for name, ms, mem in results:
            tflops = flops / (ms * 1e-3) / 1e12
            rows.append(
                [
                    name,
                    f"{ms:.2f}",
                    f"{world * t / (ms * 1e-3) / 1e6:.2f}",
                    f"{tflops:.0f}",
                    f"{tflops / peak:.0%}",
                    f"{base / ms:.2f}x",
                    f"{mem:.1f}",
                ]
            )
        env = environment()
        header = [
            "layout",
            "fwd+bwd ms",
            "Mtok/s (all GPUs)",
            "TFLOP/s per GPU",
            "of bf16 mm peak",
            "vs no EP",
            "peak mem GiB",
        ]
        text = (
            f"# MoE layer, expert parallel over {world} GPUs (all-to-all)\n\n"
            f"{world} x {env['device']}; torch {env['torch']}, triton {env['triton']}; {env['date']}\n\n"
            f"Per rank: {args.tokens} tokens, hidden {h}, {e} experts, top-{k}, FFN {f}, {str(dtype).removeprefix('torch.')}. "
            f"Mean of {args.iters} iterations after {args.warmup} warm-up, slowest rank. "
            f"bf16 matmul peak {peak:.0f} TFLOP/s. Output relative L2 difference EP vs no EP: {rel:.2e}.\n"
            f"Raw NCCL all_to_all_single of one dispatch's bytes ({buf.numel() * 2 / 2**20:.0f} MiB/rank): "
            f"{a2a_ms:.2f} ms, {a2a_gbs:.0f} GB/s off-rank per GPU (the communication ceiling; one layer "
            f"step moves this 4 times: dispatch + combine, forward + backward).\n\n"
            f"{markdown_table(header, rows)}\n"
        )
        print(text)
        if args.markdown is not None:
            args.markdown.parent.mkdir(parents=True, exist_ok=True)
            args.markdown.write_text(text)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
