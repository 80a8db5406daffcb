"""The machine ``plait plan`` prices a layout on: compute rate, collective bandwidths, memory bandwidth.

Without ``--calibrate`` the figures are the defaults below (an H200 node as measured by
``benchmarks/comms/nccl_bandwidth.py`` and the training benchmarks) or a ``--machine`` JSON file;
with it, the job's own model's forward and backward are timed on this machine's device (:func:`calibrate`: the
rate and the fixed cost of a microbatch).
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

__all__ = ["Machine", "calibrate", "load_machine"]


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
        fragmentation: the allocator's reserved over allocated bytes at the peak.
        microbatch_s: fixed seconds of one microbatch's forward and backward through the whole model
            (kernel launches, the host's work per layer), whatever its size.
        activation_scale: the activation bytes a forward of the job's model keeps on this device over the
            planner's count of them (``--calibrate`` on a GPU measures it: compiled layers may save less
            than the eager ops counted); 1 = the count.
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

    @functools.cached_property
    def _bandwidths(self) -> dict[str, float]:
        return dict(self.busbw)

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


def calibrate(
    model: torch.nn.Module, flops_per_token: float, microbatch: int, seq: int, device: torch.device
) -> tuple[float, float]:
    """``(model FLOP/s, seconds of fixed cost per microbatch)`` of ``model`` (the job's model, materialised on
    ``device``): a forward and backward timed at 1 and at ``microbatch`` samples of ``seq`` tokens; the
    difference per sample gives the rate (the training FLOPs over its time), the rest the fixed cost of a
    microbatch (launches, the host's per-layer work). With ``microbatch`` 1 the fixed cost is 0."""

    def timed(samples: int) -> float:
        ids = torch.randint(0, 100, (samples, seq), device=device)

        def step() -> None:
            out = model(input_ids=ids, labels=ids)
            loss = out["loss"] if isinstance(out, dict) else out
            loss.sum().backward()

        return _timed(step, device)

    t_full = timed(microbatch)
    if microbatch == 1:
        return flops_per_token * seq / t_full, 0.0
    per_sample = max((t_full - timed(1)) / (microbatch - 1), 1e-9)
    return flops_per_token * seq / per_sample, max(0.0, t_full - microbatch * per_sample)


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
