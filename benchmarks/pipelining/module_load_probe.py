"""Does loading a kernel for the first time wait for a NCCL receive that is still in flight?

    torchrun --standalone --nproc-per-node 2 -m benchmarks.pipelining.module_load_probe

Rank 1 posts a receive that rank 0 satisfies only after DELAY seconds; meanwhile rank 1 launches a kernel
it has never launched (a freshly compiled Triton kernel; an ATen kernel not used before). If the launch
takes about DELAY seconds, loading the kernel waited for the receive: a pipeline whose peer is itself
blocked the same way deadlocks. Prints the CUDA_MODULE_LOADING mode and the launch times.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
import triton
import triton.language as tl

DELAY = 6.0


@triton.jit
def _add(x_ptr, n, VALUE: tl.constexpr):
    i = tl.arange(0, 1024)
    m = i < n
    tl.store(x_ptr + i, tl.load(x_ptr + i, mask=m) + VALUE, mask=m)


def main() -> None:
    rank = int(os.environ["RANK"])
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", device_id=dev)
    buf = torch.zeros(1 << 20, device=dev)
    for w in dist.batch_isend_irecv(
        [dist.P2POp(dist.isend, buf, 1 - rank), dist.P2POp(dist.irecv, torch.empty_like(buf), 1 - rank)]
    ):
        w.wait()
    torch.cuda.synchronize()
    x = torch.zeros(1024, device=dev)
    _add.warmup(x, 10, VALUE=3, grid=(1,))  # compiled now, loaded at its first launch

    probes = {
        "triton kernel, first launch": lambda: _add[(1,)](x, 10, VALUE=3),
        "ATen kernel, first launch": lambda: torch.special.bessel_j1(x),
        "triton kernel, second launch": lambda: _add[(1,)](x, 10, VALUE=3),
    }
    for name, fn in probes.items():
        dist.barrier()
        torch.cuda.synchronize()
        if rank == 0:
            time.sleep(DELAY)
            works = dist.batch_isend_irecv([dist.P2POp(dist.isend, buf, 1)])
        else:
            works = dist.batch_isend_irecv([dist.P2POp(dist.irecv, buf, 0)])
            time.sleep(0.5)  # the receive kernel is now waiting on the GPU
            t0 = time.perf_counter()
            fn()
            took = time.perf_counter() - t0
            print(
                f"CUDA_MODULE_LOADING={os.environ.get('CUDA_MODULE_LOADING')}: {name} took {took:.2f} s "
                f"({'BLOCKED by the pending receive' if took > DELAY / 2 else 'not blocked'})",
                flush=True,
            )
        for w in works:
            w.wait()
        torch.cuda.synchronize()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
