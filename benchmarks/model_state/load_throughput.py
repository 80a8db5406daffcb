"""Checkpoint load throughput and peak host memory: plait.model_state vs safetensors + load_state_dict.

One command (creates the checkpoint, runs every method in its own subprocess, prints a table):

    uv run python -m benchmarks.model_state.load_throughput --size-gb 2 --device cpu
    uv run python -m benchmarks.model_state.load_throughput --size-gb 8 --device cuda

Methods (each in a fresh process, so peak memory is its own):
  plait     ``load_module(module, dir)``: streamed group by group, positioned reads straight into the
            parameters (CPU) or through two pinned buffers (CUDA).
  baseline  for each shard file ``safetensors.torch.load_file(f)`` then ``module.load_state_dict(sd,
            strict=False)`` (the usual Hugging Face pattern).

Peak host memory is the process's peak RSS during the load minus its RSS right before it (the
module's own parameters are allocated before the measurement starts). The files are read from the
page cache (they were just written, or read by the previous run): this measures the loaders, not
the disk. The hardware ceiling is host memory copy bandwidth (CPU) or pinned host-to-device copy
bandwidth (CUDA), measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
ROWS, COLS = 4096, 4096  # one large bf16 tensor = 32 MiB
DTYPE = torch.bfloat16


def _layout(size_gb: float) -> dict[str, tuple[int, ...]]:
    n = max(1, round(size_gb * 2**30 / (ROWS * COLS * 2)))
    shapes: dict[str, tuple[int, ...]] = {}
    for i in range(n):
        shapes[f"layers.{i}.weight"] = (ROWS, COLS)
        shapes[f"layers.{i}.norm"] = (COLS,)
    return shapes


def _value(i: int) -> float:
    return float(i % 61) - 30.0


def _make_checkpoint(path: Path, size_gb: float) -> int:
    """Write an HF-style sharded checkpoint (1 GiB shards) with safetensors itself."""
    from safetensors.torch import save_file

    shapes = _layout(size_gb)
    path.mkdir(parents=True, exist_ok=True)
    shard_bytes = 2**30
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    total = 0
    for i, (k, shape) in enumerate(shapes.items()):
        t = torch.full(shape, _value(i), dtype=DTYPE)
        nbytes = t.numel() * t.element_size()
        if size + nbytes > shard_bytes and shards[-1]:
            shards.append({})
            size = 0
        shards[-1][k] = t
        size += nbytes
        total += nbytes
    n = len(shards)
    weight_map = {}
    for j, part in enumerate(shards):
        name = f"model-{j + 1:05d}-of-{n:05d}.safetensors"
        save_file(part, str(path / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return total


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _module(size_gb: float, device: str) -> nn.Module:
    m = nn.Module()
    for k, shape in _layout(size_gb).items():
        i, name = k.split(".")[1], k.split(".")[2]
        if not hasattr(m, "layers"):
            m.layers = nn.ModuleList()
        while len(m.layers) <= int(i):
            m.layers.append(nn.Module())
        m.layers[int(i)].register_parameter(
            name, nn.Parameter(torch.empty(shape, dtype=DTYPE, device=device), requires_grad=False)
        )
    for p in m.parameters():
        p.data.zero_()  # touch the memory so it is resident before the measurement
    return m


def _worker(method: str, path: str, size_gb: float, device: str) -> dict[str, float]:
    torch.set_num_threads(max(1, min(8, os.cpu_count() or 1)))
    from plait.model_state import load_module
    from safetensors.torch import load_file

    module = _module(size_gb, device)
    if device == "cuda":
        torch.cuda.synchronize()
    files = sorted(Path(path).glob("*.safetensors"))
    has_peak = _reset_peak()
    base = _status("VmRSS")
    t0 = time.perf_counter()
    if method == "plait":
        load_module(module, path)
    else:
        for f in files:
            sd = load_file(str(f))
            module.load_state_dict(sd, strict=False)
            del sd
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    peak = (_status("VmHWM") - base) if has_peak else float("nan")
    # Correctness: every tensor holds its own constant.
    for i, (k, _) in enumerate(_layout(size_gb).items()):
        p = module.get_parameter(k)
        assert float(p.flatten()[-1]) == _value(i), f"{method}: wrong value in {k}"
    return {"seconds": seconds, "peak_bytes": peak}


def _ceiling(device: str) -> float:
    """Bytes/s of the copy the load ends in: host memcpy (CPU) or pinned H2D (CUDA)."""
    n = 512 * 2**20
    src = torch.empty(n, dtype=torch.uint8, pin_memory=device == "cuda")
    src.fill_(1)
    dst = torch.empty(n, dtype=torch.uint8, device=device)
    dst.copy_(src)
    best = float("inf")
    for _ in range(3):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=device == "cuda")
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return n / best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gb", type=float, default=2.0, help="checkpoint size in GiB (default 2)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--repeats", type=int, default=2, help="runs per method (alternating); best is reported")
    ap.add_argument(
        "--dir", default=None, help="where to write the checkpoint (default: a temp dir, removed after)"
    )
    ap.add_argument("--worker", choices=["plait", "baseline"], help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(_worker(args.worker, args.path, args.size_gb, args.device)))
        return
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: no CUDA device")
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="plait-ms-bench-"))
    ck = root / "ckpt"
    try:
        t0 = time.perf_counter()
        total = _make_checkpoint(ck, args.size_gb)
        print(
            f"checkpoint: {total / 2**30:.2f} GiB in {len(list(ck.glob('*.safetensors')))} files, written in {time.perf_counter() - t0:.1f}s"
        )
        runs: dict[str, list[dict[str, float]]] = {"plait": [], "baseline": []}
        for _ in range(args.repeats):
            for method in ("baseline", "plait"):
                cmd = [
                    sys.executable,
                    "-m",
                    "benchmarks.model_state.load_throughput",
                    "--worker",
                    method,
                    "--path",
                    str(ck.resolve()),
                    "--size-gb",
                    str(args.size_gb),
                    "--device",
                    args.device,
                ]
                out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
                if out.returncode != 0:
                    sys.exit(f"{method} worker failed:\n{out.stderr}")
                runs[method].append(json.loads(out.stdout.strip().splitlines()[-1]))
        ceiling = _ceiling(args.device)
        best = {m: min(r, key=lambda x: x["seconds"]) for m, r in runs.items()}
        peak = {m: max(x["peak_bytes"] for x in r) for m, r in runs.items()}
        dev = (
            torch.cuda.get_device_name()
            if args.device == "cuda"
            else platform.processor() or platform.machine()
        )
        print(
            f"\ndevice: {args.device} ({dev}), {os.cpu_count()} CPUs, torch {torch.__version__}, python {platform.python_version()}"
        )
        print(
            f"hardware ceiling ({'pinned H2D copy' if args.device == 'cuda' else 'host memcpy'}): {ceiling / 1e9:.2f} GB/s\n"
        )
        print(
            "| method | best time (s) | median time (s) | throughput (GB/s) | fraction of ceiling | peak extra host memory (MiB) |"
        )
        print("|---|---|---|---|---|---|")
        for m in ("plait", "baseline"):
            med = statistics.median(x["seconds"] for x in runs[m])
            gbs = total / best[m]["seconds"] / 1e9
            print(
                f"| {m} | {best[m]['seconds']:.2f} | {med:.2f} | {gbs:.2f} | {gbs * 1e9 / ceiling:.2f} | {peak[m] / 2**20:.0f} |"
            )
        speed = best["baseline"]["seconds"] / best["plait"]["seconds"]
        print(
            f"\nplait / baseline: throughput x{speed:.2f}, peak host memory x{peak['plait'] / max(peak['baseline'], 1):.3f}"
        )
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
