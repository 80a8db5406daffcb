"""NCCL bandwidth of this machine's GPUs: the ceiling for FSDP, expert and context parallelism.

    torchrun --standalone --nproc-per-node 2 -m benchmarks.comms.nccl_bandwidth [--mib 512]

Times all-gather, reduce-scatter, all-reduce and all-to-all of a ``--mib`` MiB bf16 buffer (per rank,
the gathered / reduced size) and a point-to-point exchange, and prints nccl-tests' bus bandwidth
(algorithm bandwidth times (n-1)/n for all-gather, reduce-scatter and all-to-all; 2(n-1)/n for
all-reduce). On rank 0 it also prints what the driver reports about the GPU links
(``nvidia-smi topo -m``), so that a slow figure can be told apart from a slow link.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import time
from collections.abc import Callable

import torch
import torch.distributed as dist


def _time(fn: Callable[[], object], iters: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=512, help="buffer size per collective, MiB")
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    dist.init_process_group("nccl")
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if rank == 0:
        topo = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True)
        print(topo.stdout or topo.stderr, flush=True)
        print(f"torch {torch.__version__}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, {n} ranks")
    numel = args.mib * 2**20 // 2
    full = torch.ones(numel, dtype=torch.bfloat16, device="cuda")
    shard = torch.ones(numel // n, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(full)
    peer = (rank + 1) % n

    def p2p() -> None:
        reqs = dist.batch_isend_irecv(
            [dist.P2POp(dist.isend, full, peer), dist.P2POp(dist.irecv, out, (rank - 1) % n)]
        )
        for r in reqs:
            r.wait()

    ops: dict[str, tuple[Callable[[], object], float]] = {
        "all_gather": (lambda: dist.all_gather_into_tensor(out, shard), (n - 1) / n),
        "reduce_scatter": (lambda: dist.reduce_scatter_tensor(shard, full), (n - 1) / n),
        "all_reduce": (lambda: dist.all_reduce(full), 2 * (n - 1) / n),
        "all_to_all": (lambda: dist.all_to_all_single(out, full), (n - 1) / n),
        "send_recv": (p2p, 1.0),
    }
    rows = []
    for name, (fn, factor) in ops.items():
        s = _time(fn, args.iters)
        algbw = full.numel() * 2 / s / 1e9
        rows.append(f"| {name} | {args.mib} | {s * 1e3:.2f} | {algbw:.1f} | {algbw * factor:.1f} |")
    if rank == 0:
        print("| collective | MiB | ms | algbw GB/s | busbw GB/s |\n|---|---:|---:|---:|---:|")
        print("\n".join(rows), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
