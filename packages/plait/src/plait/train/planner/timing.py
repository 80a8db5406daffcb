"""The machine ``plait plan`` prices a layout on: compute rate, collective bandwidths, memory bandwidth.

Without ``--calibrate`` the figures are the defaults below (an H200 node as measured by
``benchmarks/comms/nccl_bandwidth.py`` and the training benchmarks) or a ``--machine`` JSON file;
with it, the job is measured on this machine's device (``calibrated`` in the package: its model's forward and
backward, :func:`forward_backward_s`; its optimizer step, :func:`optimizer_step`; a few steps of the job
itself, :func:`run_job`).
"""

from __future__ import annotations

import contextlib
import functools
import json
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, cast

import torch
from plait.dist_core import shard_batch

__all__ = [
    "Machine",
    "expert_parallel_s",
    "forward_backward_s",
    "fsdp_s",
    "load_machine",
    "optimizer_step",
    "probe_ranks",
    "run_job",
    "split_parallel_s",
    "static_shapes",
]


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
        allocator_slack: the bytes the allocator holds reserved above the allocated ones at the peak, per byte
            of the largest layer's activations of one microbatch (freed and allocated again every step, in
            blocks the size of a microbatch's tensors: the slack grows with them, not with the model's
            states; ``--calibrate`` on a GPU measures it in a few steps of the job).
        host_s: per activation-checkpointing mode, the seconds the host takes to issue one microbatch's
            forward and backward through the whole model (Python, autograd, kernel launches), whatever its
            size: a microbatch takes at least this long, the GPU waiting when its own work is shorter
            (``--calibrate`` measures it at one sample); none = 0.
        idle_s: per mode, the seconds a GPU-bound microbatch's GPU still idles (its start, the host falling
            behind on short kernels): the wall time of a forward and backward at the job's microbatch less the
            GPU's busy time, added to the GPU work of every microbatch (``--calibrate`` on a GPU measures it);
            none = 0.
        host_overlaps: the host issues work ahead of the device (CUDA: a microbatch takes the longer of the
            two); False: the device runs each op as it is issued (a CPU: the host's time adds to the compute).
        recompute: per mode, the GPU time of a forward and backward over that without checkpointing (a
            forward is a third of it without; ``--calibrate`` measures it).
        activation_scale: per mode, the activation bytes a forward of the job's model keeps on this device
            over the planner's count of them (``--calibrate`` on a GPU measures it: compiled layers may save
            less than the eager ops counted); none = 1, the count.
        backward_scale: per mode, the bytes the backward holds at its peak above what the forward kept (a
            checkpointed layer recomputed, the backward's temporaries) over the count of the largest layer's
            unchecked activations (``--calibrate`` on a GPU measures it); default: none 0, else 1 (one layer
            recomputed as counted).
        fsdp_unit_s, fsdp_unit_gpu_s: seconds FSDP2 adds per unit to a microbatch that reduces its gradients
            (a step's last): to the host's floor (its hooks, copies in and out, the launches) and to the GPU's
            work (the collectives' kernels beside the compute, the waits for a gather or for the other ranks).
            ``--calibrate`` measures them with the job's model under FSDP2 over the GPUs it plans for (as many
            as the machine has; :func:`fsdp_s`); with the GPU's figure measured, the collectives of the units
            gathered before the first layer and reduced after the last are in it, not priced again at
            ``busbw``.
        fsdp_accumulate_s, fsdp_accumulate_gpu_s: the same for each microbatch before a step's last, whose
            gradients accumulate unreduced (measured with them; a ``--machine`` file without them: the reducing
            microbatch's).
        fsdp_unit_bytes: the mean bytes one unit of that measurement gathers (its parameters unsharded, as
            the planner counts them): the GPU's figures are for units of this size, and a layout's units scale
            them by their own mean (expert parallelism keeps the experts out of the FSDP2 units' gathers,
            tensor parallelism shrinks them); 0: not scaled.
        fsdp_slack_bytes: the bytes the allocator holds reserved above the allocated ones under FSDP2 whatever
            the microbatch (its gathers' and reductions' buffers of many sizes): an FSDP2 layout's slack is
            at least this (``--calibrate`` on the GPUs measures it at one sample).
        step_s: fixed seconds of a training step outside the microbatches' forward and backward and the
            optimizer step (the data, the loss's bookkeeping, the trainer): a few steps of the job measured.
        microbatch_s: host seconds the job adds to each microbatch beyond its model's forward and backward
            (the executor, the loss and its statistics, the microbatch's inputs), on the host's floor:
            ``--calibrate`` runs the job at one sample per microbatch, where the host bounds it.
        expert_host_s, expert_token_s: what expert parallelism adds to one MoE layer, by ``"{dispatch}:{P}"``
            (the dispatch used, ``ParallelConfig.dispatch``, over P EP ranks): seconds of the host's floor per
            microbatch (the dispatch's ops issued), and seconds of GPU work per token of a microbatch on one rank (the
            exchanges' kernels with their waits for the other ranks' experts, the dispatch's own kernels).
            ``--calibrate`` on a machine of P GPUs or more measures them (:func:`expert_parallel_s`); a layout
            without them prices the exchanges' bytes at ``busbw``.
        tensor_host_s, tensor_token_s: what tensor parallelism over P ranks (by ``"P"``) adds to one decoder
            layer: seconds of the host's floor per microbatch (the sharded tensors' dispatch, the collectives
            issued), and seconds of GPU work per token of a microbatch over the layer's compute split P ways
            (the collectives waited on inside the layer, the narrower matmuls' lost efficiency).
            ``--calibrate`` measures them (:func:`split_parallel_s`); a layout without them prices the
            collectives' bytes at ``busbw``.
        context_host_s, context_token_s: the same for context parallelism over P ranks (by ``"P"``): per token
            of a rank's sequence shard, over the layer's compute split P ways (the keys' and values' gathers
            and their gradients' reductions waited on, attention over the gathered keys, the shorter
            sequences' lost efficiency). ``--calibrate`` measures them; a layout without them prices the
            gathers' bytes at ``busbw``.
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
    allocator_slack: float = 0.0
    host_s: tuple[tuple[str, float], ...] = ()
    idle_s: tuple[tuple[str, float], ...] = ()
    host_overlaps: bool = True
    recompute: tuple[tuple[str, float], ...] = (("none", 1.0), ("selective", 1.1), ("full", 4 / 3))
    activation_scale: tuple[tuple[str, float], ...] = ()
    backward_scale: tuple[tuple[str, float], ...] = (("none", 0.0),)
    fsdp_unit_s: float = 0.0
    fsdp_unit_gpu_s: float = 0.0
    fsdp_accumulate_s: float = 0.0
    fsdp_accumulate_gpu_s: float = 0.0
    fsdp_unit_bytes: float = 0.0
    fsdp_slack_bytes: float = 0.0
    step_s: float = 0.0
    microbatch_s: float = 0.0
    expert_host_s: tuple[tuple[str, float], ...] = ()
    expert_token_s: tuple[tuple[str, float], ...] = ()
    tensor_host_s: tuple[tuple[str, float], ...] = ()
    tensor_token_s: tuple[tuple[str, float], ...] = ()
    context_host_s: tuple[tuple[str, float], ...] = ()
    context_token_s: tuple[tuple[str, float], ...] = ()

    def to_json(self) -> str:
        """The machine as JSON, what ``--machine`` reads back (the per-name figures as objects)."""
        data = {k: getattr(self, k) for k in self.__dataclass_fields__}
        return json.dumps({k: dict(v) if k in _NAMED else v for k, v in data.items()}, indent=1)

    @functools.cached_property
    def _bandwidths(self) -> dict[str, float]:
        return dict(self.busbw)

    def of_mode(self, field: str, mode: str) -> float:
        """``field``'s value (``host_s``, ``idle_s``, ``recompute``, ``activation_scale`` or
        ``backward_scale``) for checkpointing ``mode``."""
        return dict(getattr(self, field)).get(mode, 0.0 if field in ("host_s", "idle_s") else 1.0)

    def measured(self) -> str:
        """What ``--calibrate`` measures, in words."""

        def modes(field: str, fmt: str) -> str:
            return ", ".join(f"{m} {fmt.format(v)}" for m, v in getattr(self, field))

        return (f"{self.flops / 1e12:.1f} TFLOP/s; host per microbatch {modes('host_s', '{:.3f} s')}; GPU idle per "
                f"microbatch {modes('idle_s', '{:.4f} s') or '0'}; GPU time "
                f"over no checkpointing {modes('recompute', '{:.2f}x')}; activations over the count "
                f"{modes('activation_scale', '{:.2f}x') or '1'}; backward's peak over one layer's activations "
                f"{modes('backward_scale', '{:.2f}x')}; optimizer {self.optimizer_bytes_per_s / 1e9:.0f} "
                f"GB/s; FSDP2 per unit and microbatch: host {self.fsdp_unit_s * 1e3:.2f} ms, GPU "
                f"{self.fsdp_unit_gpu_s * 1e3:.2f} ms (accumulating: {self.fsdp_accumulate_s * 1e3:.2f} ms, "
                f"{self.fsdp_accumulate_gpu_s * 1e3:.2f} ms; units of {self.fsdp_unit_bytes / 1e6:.1f} MB), "
                f"allocator slack at least {self.fsdp_slack_bytes / 2**30:.2f} GiB; {self.step_s * 1e3:.1f} ms fixed per step, the "
                f"job's {self.microbatch_s * 1e3:.1f} ms per microbatch; allocator slack "
                f"{self.allocator_slack:.2f}x a layer's activations"
                + "".join(f"; {name} {k}: host {host * 1e3:.2f} ms per {layer} and microbatch, GPU "
                          f"{token * 1e9:.1f} ns per token"
                          for kind, name, layer in (("expert", "EP", "MoE layer"), ("tensor", "TP", "layer"),
                                                    ("context", "CP", "layer"))
                          for k, (host, token) in self._figures(kind).items()))  # fmt: skip

    def _figures(self, kind: str) -> dict[str, tuple[float, float]]:
        """``kind``'s (``expert``, ``tensor`` or ``context``) measured figures by key: ``(host seconds, GPU
        seconds per token)``."""
        host = dict(getattr(self, f"{kind}_host_s"))
        return {k: (host.get(k, 0.0), v) for k, v in getattr(self, f"{kind}_token_s")}

    def expert_s(self, dispatch: str, ranks: int) -> tuple[float, float] | None:
        """``(host seconds per MoE layer and microbatch, GPU seconds per token and MoE layer)`` that expert
        parallelism over ``ranks`` by ``dispatch`` adds, as measured, or None if not measured."""
        return self._figures("expert").get(f"{dispatch}:{ranks}")

    def split_s(self, kind: str, ranks: int) -> tuple[float, float] | None:
        """``(host seconds per layer and microbatch, GPU seconds per token of a rank and layer)`` that tensor
        (``kind="tensor"``) or context parallelism (``"context"``) over ``ranks`` adds, as measured, or None
        if not measured."""
        return self._figures(kind).get(str(ranks))

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


_NAMED = (
    "busbw",
    "host_s",
    "idle_s",
    "recompute",
    "activation_scale",
    "backward_scale",
    "expert_host_s",
    "expert_token_s",
    "tensor_host_s",
    "tensor_token_s",
    "context_host_s",
    "context_token_s",
)  # figures by name


def _check_figure(path: Path, key: str, value: object) -> None:
    """A figure of a ``--machine`` file: a number >= 0 (> 0 for the rates, which divide; an integer >= 1 for
    ``gpus_per_node``; ``host_overlaps`` true or false), or for the figures by name an object of them."""
    positive = key in ("flops", "busbw", "inter_node_busbw", "optimizer_bytes_per_s", "memory_gib")

    def number(v: object) -> bool:
        return isinstance(v, int | float) and not isinstance(v, bool) and (v > 0 if positive else v >= 0)

    bound = "> 0" if positive else ">= 0"
    want = f"a number {bound}"
    if key in _NAMED:
        ok = isinstance(value, dict) and all(isinstance(k, str) and number(v) for k, v in value.items())
        want = f"an object of names to numbers {bound}"
    elif key == "host_overlaps":
        ok, want = isinstance(value, bool), "true or false"
    elif key == "gpus_per_node":
        ok, want = isinstance(value, int) and not isinstance(value, bool) and value >= 1, "an integer >= 1"
    else:
        ok = number(value)
    if not ok:
        raise ValueError(f"--machine {path}: {key} must be {want}, got {value!r}")


def load_machine(path: Path | None, memory_gib: float | None) -> Machine:
    """The defaults, overridden by ``path`` (JSON with any of :class:`Machine`'s fields) and ``memory_gib``."""
    machine = Machine()
    if path is not None:
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"--machine {path}: {e}") from None
        if not isinstance(data, dict):
            raise ValueError(f"--machine {path}: a JSON object of Machine fields, got {type(data).__name__}")
        unknown = set(data) - set(Machine.__dataclass_fields__)
        if unknown:
            raise ValueError(
                f"--machine {path}: unknown fields {sorted(unknown)} (known: {sorted(Machine.__dataclass_fields__)})"
            )
        for key, value in data.items():
            _check_figure(path, key, value)
        for key in _NAMED:
            if key in data:
                data[key] = tuple({**dict(getattr(machine, key)), **data[key]}.items())  # over the defaults
        for key in ("fsdp_accumulate_s", "fsdp_accumulate_gpu_s"):  # a file from before these were measured:
            if key not in data and (unit := key.replace("accumulate", "unit")) in data:  # as the reducing one
                data[key] = data[unit]
        machine = replace(machine, **data)
    return replace(machine, memory_gib=memory_gib) if memory_gib is not None else machine


@contextlib.contextmanager
def static_shapes() -> Iterator[None]:
    """Inside: compiled layers compile each batch shape as a graph of its own, as the job's layers do for its
    one microbatch shape. Outside, a layer timed at a second sample count recompiles for any size (other
    kernels, more host time: a graph the job never runs); and as each model variant built in one process
    (other parameter types: DTensors, FSDP2's) recompiles the layers' shared code, torch's recompile limit
    soon leaves the later variants uncompiled: call ``torch.compiler.reset()`` before each. A context manager
    or a function's decorator."""
    with torch._dynamo.config.patch(automatic_dynamic_shapes=False):  # noqa: SLF001 (no torch.compiler name)
        yield


def _timed(fn: Callable[[], object], device: torch.device, repeats: int = 3, rounds: int = 3) -> float:
    """Seconds of one ``fn()``: the mean of ``repeats`` calls in the fastest of ``rounds`` (whatever else
    the host runs only slows a round), after a warm-up."""
    fn()  # warm-up: twice, the first call of a process runs slower beyond its compile (an H200: 48 ms, then 35)
    fn()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    best = float("inf")
    for _ in range(rounds):
        sync()
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        sync()
        best = min(best, (time.perf_counter() - t0) / repeats)
    return best


def packed_batch(samples: int, seq: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Random tokens as ``plait train``'s packed data feeds the model: with their positions and document
    ids (one document per row here), so that attention takes the job's kernel (without flash-attn,
    document-masked FlexAttention on a GPU; a plain causal batch would take SDPA's flash kernel there,
    which runs at another speed and keeps other tensors for its backward)."""
    ids = torch.randint(0, 100, (samples, seq), device=device)
    positions = torch.arange(seq, device=device).expand(samples, seq)
    return {"input_ids": ids, "labels": ids, "position_ids": positions, "document_ids": torch.zeros_like(ids)}


def forward_backward_s(
    model: torch.nn.Module,
    samples: int,
    seq: int,
    device: torch.device,
    *,
    busy: bool = False,
    context: tuple[int, int] | None = None,
) -> float:
    """Seconds of one forward and backward of ``model`` on ``samples`` x ``seq`` random tokens
    (:func:`packed_batch`; with ``context=(P, rank)`` that rank's shard of them, as the job feeds a model
    context-parallel over P ranks), after a warm-up:
    the wall time (device synchronised), or with ``busy`` the time the device spends in its kernels and copies
    (CUDA: summed from the profiler's device records; elsewhere the wall time: the CPU runs them as it goes)."""
    batch = packed_batch(samples, seq, device)
    if context is not None:
        batch = shard_batch(batch, *context)

    def step() -> None:
        out = model(**batch)
        loss = out["loss"] if isinstance(out, dict) else out
        loss.sum().backward()

    if not busy or device.type != "cuda":
        return _timed(step, device)
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize(device)
    events = prof.key_averages()
    # kernels and copies; not the regions (``record_function``, the profiler's step) that span them
    kernels = [e for e in events if e.device_type == DeviceType.CUDA and not e.is_user_annotation]
    return sum(e.self_device_time_total for e in kernels) / 1e6


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


def _why(proc: subprocess.CompletedProcess[str]) -> str:
    """A failed run's reason: under torchrun the last error a rank raised (torchrun's own summary follows
    it), else the run's last line."""
    lines = (proc.stderr or proc.stdout).strip().splitlines()
    raised = [x for x in lines if re.match(r"\[rank\d+\]: \w*(Error|Exception): ", x)]
    return (raised or lines or [""])[-1].strip()[:200]


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
            raise RuntimeError(f"plait train exited with {proc.returncode}: {_why(proc)}")
        records = [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in records if "tokens_per_s" in r]
    if not timed:
        raise RuntimeError("plait train logged no throughput")
    peak = [max(r.get(key) or 0.0 for r in timed) for key in ("mem_allocated_gib", "mem_reserved_gib")]
    return timed[-1]["tokens_per_s"] / gpus, peak[0], peak[1]


def probe_ranks(
    config: Path,
    ranks: int,
    *,
    expert_samples: int = 0,
    fsdp_samples: int = 0,
    tensor_samples: int = 0,
    context_samples: int = 0,
) -> dict[str, Any]:
    """The job's model (``config``) timed on ``ranks`` of this machine's GPUs (gloo ranks of the CPU without
    CUDA) by :mod:`~plait.train.planner.rank_probe`: the slowest rank's seconds of a forward and backward,
    ``{"plain": {samples: s}, "experts": {...}, "fsdp": {...}, "fsdp_accumulating": {...}, "tensor": {...},
    "context": {...}, "fsdp_units": n, "slack": {variant: bytes}}``, with the experts sharded when
    ``expert_samples``, under FSDP2 when ``fsdp_samples``, tensor-parallel when ``tensor_samples`` and
    context-parallel when ``context_samples`` (string keys: the JSON's).

    Raises:
        RuntimeError: the probe failed (its exit status and the error it named).
    """
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "times.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", "-m",
               "plait.train.planner.rank_probe", "--config", str(config), "--expert-samples", str(expert_samples),
               "--fsdp-samples", str(fsdp_samples), "--tensor-samples", str(tensor_samples),
               "--context-samples", str(context_samples), "--out", str(out)]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            raise RuntimeError(f"the {ranks}-rank probe exited with {proc.returncode}: {_why(proc)}")
        return cast(dict[str, Any], json.loads(out.read_text()))


def _extra(times: dict[str, Any], variant: str, samples: int) -> float:
    """What ``variant`` adds to the plain model's wall time at ``samples`` (not below 0)."""
    return max(0.0, times[variant][str(samples)] - times["plain"][str(samples)])


def _host_extra(times: dict[str, Any], variant: str) -> float:
    """What ``variant`` adds to the plain model's host floor (not below 0): each model's lowest wall time at
    any sample count (every one bounds the floor from above; one sample's, unless a slow timing of it)."""
    return max(0.0, min(times[variant].values()) - min(times["plain"].values()))


def expert_parallel_s(times: dict[str, Any], samples: int, seq: int, moe_layers: int) -> tuple[float, float]:
    """What expert parallelism adds to each of the model's ``moe_layers``, from :func:`probe_ranks`'
    ``times`` (``expert_samples=samples``): ``(host seconds per microbatch, GPU seconds per token)``, the
    experts sharded less the plain model on the host's floor (:func:`_host_extra`) and at ``samples`` of
    ``seq`` tokens (the GPU bounds it)."""
    host, gpu = _host_extra(times, "experts"), _extra(times, "experts", samples)
    return host / moe_layers, gpu / (samples * seq) / moe_layers


def split_parallel_s(
    times: dict[str, Any], kind: str, samples: int, seq: int, layers: int
) -> tuple[float, float]:
    """What tensor (``kind="tensor"``) or context parallelism (``"context"``) over the probe's P ranks adds to
    each of the model's ``layers``, from :func:`probe_ranks`' ``times`` (``tensor_samples=samples`` or
    ``context_samples=samples``): ``(host seconds per microbatch, GPU seconds per token of a rank)``, the
    split model less the plain one on the host's floor (:func:`_host_extra`) and at ``samples`` less the plain
    model's time split P ways (the GPU bounds it; not below 0). A rank's tokens: all ``samples x seq`` under
    tensor parallelism, its ``1/P`` shard of them under context parallelism."""
    ranks = int(times["ranks"])
    host = _host_extra(times, kind)
    gpu = max(0.0, times[kind][str(samples)] - times["plain"][str(samples)] / ranks)
    tokens = samples * seq // (ranks if kind == "context" else 1)
    return host / layers, gpu / tokens / layers


def fsdp_s(times: dict[str, Any], samples: int) -> dict[str, float]:
    """What FSDP2 adds per unit to a microbatch, from :func:`probe_ranks`' ``times``
    (``fsdp_samples=samples``), as :class:`Machine`'s ``fsdp_*`` figures: FSDP2 less the plain model on the
    host's floor (the hooks, the copies in and out, the launches: :func:`_host_extra`, at one sample or at the
    job's microbatch) and at ``samples`` (enough for the GPU to bound both, the GPU's: the collectives' kernels
    beside the compute, the waits for a gather not yet done or for the other ranks), for a microbatch that
    reduces its gradients and for one that accumulates them; and the allocator's slack under FSDP2 at one
    sample (0 without a GPU's measurement)."""
    units = times["fsdp_units"]
    return {"fsdp_unit_s": _host_extra(times, "fsdp") / units,
            "fsdp_unit_gpu_s": _extra(times, "fsdp", samples) / units,
            "fsdp_accumulate_s": _host_extra(times, "fsdp_accumulating") / units,
            "fsdp_accumulate_gpu_s": _extra(times, "fsdp_accumulating", samples) / units,
            "fsdp_slack_bytes": float(times.get("slack", {}).get("fsdp", 0.0))}  # fmt: skip


def activation_bytes(model: torch.nn.Module, samples: int, seq: int, device: torch.device) -> tuple[int, int]:
    """Bytes a CUDA forward and backward of ``model`` on ``samples`` x ``seq`` tokens allocate above its
    parameters and gradients: ``(kept after the forward, graph alive: the saved tensors and the loss; the
    peak of the forward and backward)``."""
    batch = packed_batch(samples, seq, device)

    def loss() -> torch.Tensor:
        out = model(**batch)
        return (out["loss"] if isinstance(out, dict) else out).sum()

    loss().backward()  # warm: compiled graphs, workspaces and the gradients allocated once
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    value = loss()
    torch.cuda.synchronize(device)
    kept = torch.cuda.memory_allocated(device) - before
    value.backward()
    del value
    torch.cuda.synchronize(device)
    return kept, torch.cuda.max_memory_allocated(device) - before
