"""Expert-parallel MoE layer (all-to-all dispatch, EP=2) forward+backward throughput on 2 GPUs.

Run with torchrun (one process per GPU):

    torchrun --standalone --nproc-per-node 2 -m benchmarks.moe.ep_all_to_all [--markdown benchmarks/results/moe_ep_all_to_all.md]

Every rank routes its own ``--tokens`` tokens. Compared in the same run: the same layer without
expert parallelism (every GPU holds all experts, no communication), and the raw NCCL
``all_to_all_single`` rate for the bytes one dispatch moves (the communication ceiling). Outputs of
the two layouts are checked against each other.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from plait.moe import expert_parallel

from benchmarks.moe._common import (
    EPBench,
    bf16_matmul_tflops,
    cuda_time_ms,
    environment,
    ep_parser,
    layer_flops,
    markdown_table,
    timing_rows,
)


def main() -> None:
    args = ep_parser(__doc__, tokens=16384, hidden=2048, experts=128, ffn=768).parse_args()
    b = EPBench.start(args)
    dev, dtype, world = b.dev, b.dtype, b.world
    local_layer = b.make_layer()
    ep_layer = expert_parallel(b.make_layer(), b.mesh)

    with torch.no_grad():
        y_ep, y_local = ep_layer(b.x).hidden_states.float(), local_layer(b.x).hidden_states.float()
    rel = ((y_ep - y_local).norm() / y_local.norm()).item()

    results = [
        (name, *b.time(layer))
        for name, layer in (
            (f"plait EP={world} all-to-all", ep_layer),
            ("plait no EP (all experts per GPU)", local_layer),
        )
    ]

    # Communication ceiling: one dispatch's bytes (T*k rows, evenly split) through all_to_all_single.
    buf = torch.randn(args.tokens * args.topk, args.hidden, device=dev, dtype=dtype)
    out = torch.empty_like(buf)
    a2a_ms = cuda_time_ms(lambda: dist.all_to_all_single(out, buf), 3, args.iters)
    a2a_gbs = buf.numel() * buf.element_size() * (world - 1) / world / (a2a_ms * 1e-3) / 1e9
    peak = bf16_matmul_tflops()

    t, k, h, f, e = args.tokens, args.topk, args.hidden, args.ffn, args.experts
    flops = layer_flops(t, k, h, f, e)  # per rank
    rows = timing_rows(results, flops, peak, world * t, results[1][1])
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
    b.finish(text)


if __name__ == "__main__":
    main()
