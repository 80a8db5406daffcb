"""The machine ``plait plan`` prices a layout on: compute rate, collective bandwidths, memory bandwidth.

Without ``--calibrate`` the figures are the defaults below (an H200 node as measured by
``benchmarks/comms/nccl_bandwidth.py`` and the training benchmarks) or a ``--machine`` JSON file;
with it, the job is measured on this machine's device (``calibrated`` in the package: its model's forward and
backward at two sizes, :func:`calibrate`; its optimizer step, :func:`optimizer_step`; FSDP2's cost per unit;
a few steps of the job itself, :func:`run_job`).
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

__all__ = ["Machine", "calibrate", "load_machine", "optimizer_step", "run_job"]


@dataclass(frozen=True)
class Machine:
    """What a layout's step is priced with.

    Attributes:
        flops: model FLOP/s one GPU sustains in the training step (forward and backward of the job's model).
        busbw: NCCL bus bandwidth within a node, bytes/s, per collective (nccl-tests' definition).
        inter_node_busbw: bus bandwidth of collectives that cross nodes (HSDP's replica all-reduce).
        optimizer_bytes_per_s: bytes of parameters, gradients and moments the optimizer step moves per second.
        latency_s: fixed cost of one collective.
        memory_gib: memory of one GPU.
        gpus_per_node: GPUs of one node (tensor parallelism stays within one).
        fragmentation: the allocator's reserved over allocated bytes at the peak (``--calibrate`` on a GPU
            measures it in a few steps of the job).
        microbatch_s: fixed seconds of one microbatch's forward and backward through the whole model
            (kernel launches, the host's work per layer), whatever its size.
        activation_scale: the activation bytes a forward of the job's model keeps on this device over the
            planner's count of them (``--calibrate`` on a GPU measures it: compiled layers may save less
            than the eager ops counted); 1 = the count.
        fsdp_unit_s: seconds FSDP2 adds per unit and microbatch besides its collectives' transfer time (its
            hooks, copies in and out, the launches): measured on a one-rank FSDP2 model.
        step_s: fixed seconds of a training step outside the microbatches' forward and backward and the
            optimizer step (the data, the loss's bookkeeping, the trainer): a few steps of the job measured.
    """

    flops: float = 400e12
    busbw: tuple[tuple[str, float], ...] = (
        ("all_gather", 256e9),
        ("reduce_scatter", 248e9),
        ("all_reduce", 314e9),
        ("all_to_all", 295e9),
        ("send_recv", 352e9),
    )
    inter_node_busbw: float = 40e9
    optimizer_bytes_per_s: float = 1.5e12
    latency_s: float = 20e-6
    memory_gib: float = 139.8
    gpus_per_node: int = 8
    fragmentation: float = 1.0
    microbatch_s: float = 0.0
    activation_scale: float = 1.0
    fsdp_unit_s: float = 0.0
    step_s: float = 0.0

    @functools.cached_property
    def _bandwidths(self) -> dict[str, float]:
        return dict(self.busbw)

    def measured(self) -> str:
        """What ``--calibrate`` measures, in words."""
        return (f"{self.flops / 1e12:.1f} TFLOP/s, {self.microbatch_s * 1e3:.1f} ms fixed per microbatch, optimizer "
                f"{self.optimizer_bytes_per_s / 1e9:.0f} GB/s, FSDP2 {self.fsdp_unit_s * 1e3:.2f} ms per unit and "
                f"microbatch, {self.step_s * 1e3:.1f} ms fixed per step, activation scale {self.activation_scale:.2f}, "
                f"fragmentation {self.fragmentation:.2f}")  # fmt: skip

    def bandwidth(self, collective: str) -> float:
        return self._bandwidths[collective]

    def collective_s(self, collective: str, nbytes: float, ranks: int, *, inter_node: bool = False) -> float:
        """Seconds of one collective over ``ranks`` on ``nbytes`` (the gathered / reduced size), as
        nccl-tests defines bus bandwidth: all-reduce moves ``2 (n-1)/n``, the others ``(n-1)/n``."""
        if ranks <= 1 or nbytes <= 0:
            return 0.0
        factor = 2 * (ranks - 1) / ranks if collective == "all_reduce" else (ranks - 1) / ranks
        bw = self.inter_node_busbw if inter_node else self.bandwidth(collective)
        return self.latency_s + nbytes * factor / bw


def load_machine(path: Path | None, memory_gib: float | None) -> Machine:
    """The defaults, overridden by ``path`` (JSON with any of :class:`Machine`'s fields) and ``memory_gib``."""
    machine = Machine()
    if path is not None:
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"--machine {path}: {e}") from None
        unknown = set(data) - set(Machine.__dataclass_fields__)
        if unknown:
            raise ValueError(
                f"--machine {path}: unknown fields {sorted(unknown)} (known: {sorted(Machine.__dataclass_fields__)})"
            )
        if "busbw" in data:
            data["busbw"] = tuple({**dict(machine.busbw), **data["busbw"]}.items())
        machine = replace(machine, **data)
    return replace(machine, memory_gib=memory_gib) if memory_gib is not None else machine


def _timed(fn: Callable[[], object], device: torch.device, repeats: int = 3) -> float:
    fn()  # warm-up
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync()
    return (time.perf_counter() - t0) / repeats


def forward_backward_s(model: torch.nn.Module, samples: int, seq: int, device: torch.device) -> float:
    """Seconds of one forward and backward of ``model`` on ``samples`` x ``seq`` random tokens (device
    synchronised; after a warm-up)."""
    ids = torch.randint(0, 100, (samples, seq), device=device)

    def step() -> None:
        out = model(input_ids=ids, labels=ids)
        loss = out["loss"] if isinstance(out, dict) else out
        loss.sum().backward()

    return _timed(step, device)


def calibrate(
    model: torch.nn.Module, flops_per_token: float, microbatch: int, seq: int, device: torch.device
) -> tuple[float, float, float]:
    """``(model FLOP/s, seconds of fixed cost per microbatch, seconds of a microbatch)`` of ``model`` (the job's model, materialised on
    ``device``): a forward and backward timed at 1 and at ``microbatch`` samples of ``seq`` tokens; the
    difference per sample gives the rate (the training FLOPs over its time), the rest the fixed cost of a
    microbatch (launches, the host's per-layer work). With ``microbatch`` 1 the fixed cost is 0."""
    t_full = forward_backward_s(model, microbatch, seq, device)
    if microbatch == 1:
        return flops_per_token * seq / t_full, 0.0, t_full
    per_sample = max((t_full - forward_backward_s(model, 1, seq, device)) / (microbatch - 1), 1e-9)
    return flops_per_token * seq / per_sample, max(0.0, t_full - microbatch * per_sample), t_full


def optimizer_step(optimizer: torch.optim.Optimizer, device: torch.device) -> tuple[float, int]:
    """``(seconds, bytes moved)`` of one ``optimizer.step()`` over parameters that hold gradients: the
    parameters read and written, the gradients read, the moments read and written (the state's tensors
    with the parameters' shape)."""
    step_s = _timed(optimizer.step, device)  # the warm-up step creates the moments
    moved = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is None:
                continue
            moments = [t for t in optimizer.state[p].values() if torch.is_tensor(t) and t.shape == p.shape]
            moved += 2 * p.nbytes + p.grad.nbytes + 2 * sum(t.nbytes for t in moments)
    return step_s, moved


def run_job(
    config: Path, gpus: int, overrides: Sequence[str], steps: int, cwd: Path | None = None
) -> tuple[float, float, float]:
    """``plait train --config config`` with ``overrides`` for ``steps`` steps on ``gpus`` processes (torchrun
    when more than one), without checkpoints, evaluation or export: ``(tokens per second per GPU over the
    last logging interval, the main rank's peak allocated GiB and peak reserved GiB; 0 without CUDA)``. The
    first interval, which holds the compile, is left out of the rate when ``steps >= 2``.

    Raises:
        RuntimeError: the run failed (its exit status and last line of output) or logged no throughput.
    """
    with tempfile.TemporaryDirectory() as run_dir:
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}"]
        cmd = [*(torchrun if gpus > 1 else [sys.executable]), "-m", "plait", "train", "--config", str(config),
               "--steps", str(steps), "--run-dir", run_dir, "--no-export", "--checkpoint.enabled=false",
               "--evaluation.enabled=false", "--logging.progress_bar=false",
               f"--logging.interval={max(1, steps // 2)}", *overrides]  # fmt: skip
        proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            lines = (proc.stderr or proc.stdout).strip().splitlines()
            raise RuntimeError(
                f"plait train exited with {proc.returncode}: {lines[-1][:200] if lines else ''}"
            )
        records = [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in records if "tokens_per_s" in r]
    if not timed:
        raise RuntimeError("plait train logged no throughput")
    peak = [max(r.get(key) or 0.0 for r in timed) for key in ("mem_allocated_gib", "mem_reserved_gib")]
    return timed[-1]["tokens_per_s"] / gpus, peak[0], peak[1]


def activation_bytes(model: torch.nn.Module, samples: int, seq: int, device: torch.device) -> int:
    """Bytes a CUDA forward of ``model`` on ``samples`` x ``seq`` tokens keeps allocated for its backward
    (allocated after the forward, graph alive, minus before: the saved tensors and the loss)."""
    ids = torch.randint(0, 100, (samples, seq), device=device)
    model(input_ids=ids, labels=ids)  # warm: compiled graphs and workspaces allocated once
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    out = model(input_ids=ids, labels=ids)
    torch.cuda.synchronize(device)
    kept = torch.cuda.memory_allocated(device) - before
    del out
    return kept
