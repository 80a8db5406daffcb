"""What one GPU of a layout holds: the sharded model states, exactly, and the activations, measured.

States (parameters, gradients, optimizer moments) come from the job's own model built on the meta device
and parallelised by the job's own plan (TP, EP, FSDP2) under torch's ``fake`` process group of the
layout's world size: no memory, no GPU, any model size. Each pipeline rank's stages are built as that
rank builds them (:func:`fake_world` re-creates the group as the rank with that pipeline coordinate and
data / context / tensor coordinate 0, which holds the largest FSDP shard where shards are uneven).

Activations come from one forward of the job's unsharded model on the meta device per microbatch shape
and checkpointing mode: every tensor autograd saves is counted once (by storage) and attributed to the
decoder layer it was saved in, or to the stage's ends (embedding, head and loss). Selective checkpointing
saves its ops' outputs outside those hooks, so they are counted from the outputs of the policy's ops in
the unchecked forward. Tensors whose last dim is not the model width are divided by the tensor-parallel
degree (heads and FFN width are split; the residual stream is not), when a layout's stage is priced.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from plait.dist_core import DeviceMeshParameters, DistributedContext
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["ActivationProfile", "StateBytes", "activation_profile", "fake_world", "state_bytes"]

# Mesh dims over which FSDP2 shards parameters (what its all-gather undoes).
_FSDP_DIMS = ("dp_cp_shard", "ep_replicate")


@dataclass(frozen=True)
class StateBytes:
    """Bytes of model state on one rank.

    Attributes:
        params, grads, optimizer: the local shards (gradients of trainable parameters in their dtype,
            the optimizer's moments: two per parameter for AdamW, one for SGD with momentum, none without).
        gathered: per FSDP2 unit, the bytes its all-gather materialises (the unit's parameters unsharded
            over the FSDP dims, in their dtype), outermost unit last.
    """

    params: int
    grads: int
    optimizer: int
    gathered: tuple[int, ...]

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


@contextlib.contextmanager
def fake_world(world: int, rank: int) -> Iterator[None]:
    """torch's ``fake`` process group of ``world`` ranks as ``rank`` (collectives do nothing), then none."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("plait plan builds layouts under a fake process group: run it without one")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def context(mesh: DeviceMeshParameters, rank: int) -> DistributedContext:
    """A :class:`DistributedContext` of ``mesh`` for ``rank`` over the current (fake) group, on CPU."""
    world = dist.get_world_size()
    return DistributedContext(
        mesh, torch.device("cpu"), rank=rank, world_size=world, local_rank=rank, local_world_size=world,
        node_rank=0, owns_default_group=False,
    )  # fmt: skip


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _gather_factor(p: torch.Tensor) -> int:
    from torch.distributed.tensor import DTensor

    if not isinstance(p, DTensor):
        return 1
    names = p.device_mesh.mesh_dim_names or ()
    factor = 1
    for i, placement in enumerate(p.placements):
        if placement.is_shard() and names[i] in _FSDP_DIMS:
            factor *= p.device_mesh.size(i)
    return factor


def _moments(optimizer: Any) -> tuple[int, torch.dtype | None]:
    """Moments per parameter and their dtype (None: the parameter's) of an optimizer section."""
    name = getattr(optimizer, "name", "adamw")
    if name == "sgd":
        return (1 if optimizer.momentum > 0 else 0), None
    if name == "stochastic_adamw":
        return 2, getattr(torch, optimizer.moment_dtype)
    return 2, None


def state_bytes(stages: Sequence[nn.Module], optimizer: Any) -> StateBytes:
    """The local model state of ``stages`` (one rank's, built on meta and parallelised)."""
    from torch.distributed.fsdp import FSDPModule

    moments, moment_dtype = _moments(optimizer)
    params = grads = opt = 0
    seen: set[int] = set()
    for stage in stages:
        for p in stage.parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            local = _local(p)
            nbytes = local.numel() * local.element_size()
            params += nbytes
            if p.requires_grad:
                grads += nbytes
                size = local.element_size() if moment_dtype is None else moment_dtype.itemsize
                opt += moments * local.numel() * size
    gathered = []
    owned: set[int] = set()
    for stage in stages:
        units = [m for m in stage.modules() if isinstance(m, FSDPModule)]
        for unit in reversed(units):  # innermost first: a parameter belongs to the innermost unit holding it
            unit_bytes = 0
            for p in unit.parameters():
                if id(p) in owned or _gather_factor(p) == 1:
                    continue
                owned.add(id(p))
                local = _local(p)
                unit_bytes += local.numel() * local.element_size() * _gather_factor(p)
            gathered.append(unit_bytes)
    return StateBytes(params, grads, opt, tuple(gathered))


@dataclass(frozen=True)
class ActivationProfile:
    """Activation bytes of one microbatch, per decoder layer and at the model's ends, each as a pair
    (bytes of tensors as wide as the model, the other bytes: those tensor parallelism splits).

    Attributes:
        layers: what each decoder layer keeps for its backward, by global layer index.
        ends: what is kept outside the decoder layers: (embedding side, head and loss side).
        transient: the largest unchecked layer (what a checkpointed layer holds while it is recomputed in
            the backward; zeros without checkpointing).
    """

    layers: tuple[tuple[int, int], ...]
    ends: tuple[tuple[int, int], tuple[int, int]]
    transient: tuple[int, int]

    def scaled(self, factor: float) -> ActivationProfile:
        def f(pair: tuple[int, int]) -> tuple[int, int]:
            return (int(pair[0] * factor), int(pair[1] * factor))

        return ActivationProfile(
            tuple(map(f, self.layers)), (f(self.ends[0]), f(self.ends[1])), f(self.transient)
        )

    @staticmethod
    def split(pair: tuple[int, int], tp: int) -> int:
        return pair[0] + pair[1] // tp

    def stage(self, layers: Sequence[int], first: bool, last: bool, tp: int) -> int:
        """Bytes one microbatch keeps on a stage of ``layers`` (with the embedding / the head)."""
        total = sum(self.split(self.layers[i], tp) for i in layers)
        return total + self.split(self.ends[0], tp) * first + self.split(self.ends[1], tp) * last


class _OpOutputs(TorchDispatchMode):
    """Bytes of the outputs of ``ops`` per current layer (what selective checkpointing saves)."""

    def __init__(self, ops: frozenset[str], where: list[int], hidden: int) -> None:
        super().__init__()
        self.ops, self.where, self.hidden = ops, where, hidden
        self.bytes: dict[int, list[int]] = defaultdict(lambda: [0, 0])

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if str(func) in self.ops and self.where[0] >= 0:
            for t in out if isinstance(out, tuple | list) else (out,):
                if isinstance(t, torch.Tensor):
                    _add(self.bytes[self.where[0]], t, self.hidden)
        return out


def _add(acc: list[int], t: torch.Tensor, hidden: int) -> None:
    acc[0 if t.dim() and t.shape[-1] == hidden else 1] += t.numel() * t.element_size()


def _saved_bytes(
    model: nn.Module, ids: torch.Tensor, hidden: int, sac_ops: frozenset[str] | None = None
) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
    """One meta forward of ``model``: saved bytes per layer index (-1: before the layers, -2: after), and
    the bytes of ``sac_ops``' outputs per layer."""
    where = [-1]
    saved: dict[int, list[int]] = defaultdict(lambda: [0, 0])
    storages: set[int] = set()
    handles = []
    for layer in model.decoder_layers():  # type: ignore[operator]
        handles.append(
            layer.register_forward_pre_hook(lambda m, a, i=layer.layer_idx: where.__setitem__(0, i))
        )
        handles.append(layer.register_forward_hook(lambda m, a, o: where.__setitem__(0, -2)))

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = id(t.untyped_storage())
        if key not in storages and not isinstance(t, nn.Parameter):
            storages.add(key)
            _add(saved[where[0]], t, hidden)
        return t

    mode = _OpOutputs(sac_ops, where, hidden) if sac_ops else None
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), mode or contextlib.nullcontext():
            model(input_ids=ids, labels=ids)
    finally:
        for h in handles:
            h.remove()
    return saved, mode.bytes if mode is not None else {}


def activation_profile(
    build: Any, mode: str, save_ops: Sequence[str], microbatch: int, seq: int, hidden: int, layers: int
) -> ActivationProfile:
    """Activation bytes of one microbatch of ``[microbatch, seq]`` tokens under checkpointing ``mode``.

    ``build(mode)`` returns the job's whole model (one stage) on meta, with that checkpointing applied and
    nothing compiled.
    """
    ids = torch.zeros(microbatch, seq, dtype=torch.long, device="meta")
    plain, sac = _saved_bytes(
        build("none"), ids, hidden, frozenset(save_ops) if mode == "selective" else None
    )

    def pair(d: dict[int, list[int]], i: int) -> tuple[int, int]:
        v = d.get(i, [0, 0])
        return (v[0], v[1])

    ends = (pair(plain, -1), pair(plain, -2))
    if mode == "none":
        return ActivationProfile(tuple(pair(plain, i) for i in range(layers)), ends, (0, 0))
    checked, _ = _saved_bytes(build("full"), ids, hidden)
    per_layer = tuple(
        (pair(checked, i)[0] + pair(sac, i)[0], pair(checked, i)[1] + pair(sac, i)[1]) for i in range(layers)
    )
    biggest = max((pair(plain, i) for i in range(layers)), key=sum)
    return ActivationProfile(per_layer, ends, biggest)
