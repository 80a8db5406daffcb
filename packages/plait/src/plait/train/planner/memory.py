"""What one GPU of a layout holds: the sharded model states, exactly, and the activations, measured.

Both come from the job's own model built on the meta device with one or two decoder layers of each kind
(MoE or dense, attention window, layer type; :func:`stand_ins`) and mapped onto every layer of their kind,
so that a model of any size and depth is measured in seconds.

States (parameters, gradients, optimizer moments) come from each stage built that way and parallelised by
the job's own plan (TP, EP, FSDP2) under torch's ``fake`` process group of the layout's world size: no
memory, no GPU. A stage is built as the pipeline rank that holds it builds it (:func:`fake_world`
re-creates the group as the rank with that pipeline coordinate and data / context / tensor coordinate 0,
which holds the largest FSDP shard where shards are uneven). Layers of a kind are sharded alike, so the
sums are those of the whole stage, byte for byte.

Activations come from one forward of the job's unsharded model on the meta device per sequence length,
unchecked and fully checkpointed: every tensor autograd saves is counted once (by storage) and attributed
to the decoder layer it was saved in, or to the stage's ends (embedding, head and loss). Selective
checkpointing saves its ops' outputs outside those hooks, so they are counted from the outputs of the
policy's ops in the unchecked forward. Attention counts what the fused kernels of real runs save (inputs,
output, log-sum-exp: :func:`fused_attention`), not the ``[L, S]`` probabilities of SDPA's math path,
which meta tensors would take. Tensors whose last dim is not the model width are divided by the
tensor-parallel degree (heads and FFN width are split; the residual stream is not), when a layout's stage
is priced.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from plait.dist_core import DeviceMeshParameters, DistributedContext
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "ActivationProfile",
    "SavedBytes",
    "StateBytes",
    "activation_profile",
    "fake_world",
    "keep_layers",
    "saved_bytes",
    "stand_ins",
    "state_bytes",
]

# Mesh dims over which FSDP2 shards parameters (what its all-gather undoes).
_FSDP_DIMS = ("dp_cp_shard", "ep_replicate")

SavedBytes = dict[int, list[int]]  # per layer index (-1: before the layers, -2: after): [model-wide, other]


def stand_ins(config: Any, layer_ids: Sequence[int]) -> dict[int, int]:
    """Each of ``layer_ids``' stand-in: itself for the first two layers of each kind (MoE or dense, window,
    layer type: what ``plait.models.estimate_num_parameters`` tells apart), the second of its kind for the
    others. A layer holds and saves what any layer of its kind does, except that tensors several layers
    save (the rotary tables, a window's mask) are counted on the first that saves them."""
    kept: dict[tuple[Any, ...], list[int]] = defaultdict(list)
    out = {}
    for i in layer_ids:
        first = kept[(config.is_moe_layer(i), config.sliding_window_of(i), config.layer_type_of(i))]
        if len(first) < 2:
            first.append(i)
        out[i] = first[-1]
    return out


def keep_layers(stage: nn.Module, keep: Collection[int]) -> nn.Module:
    """``stage`` (just built, not parallelised) without its decoder layers whose index is not in ``keep``."""
    layers = stage.get_submodule("model.layers")  # the trunk's layers by global index
    assert isinstance(layers, nn.ModuleDict)
    for key in [k for k in layers if int(k) not in keep]:
        del layers[key]
    return stage


@dataclass(frozen=True)
class StateBytes:
    """Bytes of model state on one rank.

    Attributes:
        params, grads, optimizer: the local shards (gradients of trainable parameters in their dtype,
            the optimizer's moments: two per parameter for AdamW, one for SGD with momentum, none without).
        gathered: per FSDP2 unit, the bytes its all-gather materialises (the unit's parameters unsharded
            over the FSDP dims, in their dtype; 0 for a root without parameters, e.g. a middle pipeline
            stage's), outermost unit last (stage by stage).
        outer_grads: the part of ``grads`` outside the decoder layers (embeddings, head, final norm).
        leading: of ``gathered``, the bytes of the units the forward gathers before the stage's first decoder
            layer and the backward reduce-scatters after its last (the embedding's and the root's): FSDP2's
            communication no layer's compute hides.
    """

    params: int
    grads: int
    optimizer: int
    gathered: tuple[int, ...]
    outer_grads: int = 0
    leading: int = 0

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def units(self) -> int:
        """The FSDP2 units that gather parameters (those whose hooks do work)."""
        return sum(1 for b in self.gathered if b)

    def __add__(self, other: StateBytes) -> StateBytes:
        """The states of two stages on one rank."""
        return StateBytes(
            self.params + other.params, self.grads + other.grads, self.optimizer + other.optimizer,
            self.gathered + other.gathered, self.outer_grads + other.outer_grads, self.leading + other.leading,
        )  # fmt: skip


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
        # Shard, or the _StridedShard FSDP2 puts on a dim it shards a tensor already sharded on a later dim
        # (e.g. experts over ep_replicate after expert parallelism over ep_shard)
        if hasattr(placement, "dim") and names[i] in _FSDP_DIMS:
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


def _layer_units(units: list[tuple[int | None, bool, int]], built: list[int], per_unit: int) -> list[int]:
    """The gathered bytes of the stage's decoder-layer units, last first: ``built`` lists, per decoder layer
    in order, the built layer standing for it; each run of ``per_unit`` layers shares one unit (the layers'
    own units summed), units inside a layer (e.g. its experts') stay one per layer."""
    out: list[int] = []
    for start in reversed(range(0, len(built), per_unit)):
        group = built[start : start + per_unit]
        out += [b for j in reversed(group) for held, whole, b in units if held == j and not whole]
        out.append(sum(b for j in group for held, whole, b in units if held == j and whole))
    return out


def state_bytes(
    stage: nn.Module, optimizer: Any, stand_in: Mapping[int, int] | None = None, layers_per_unit: int = 1
) -> StateBytes:
    """The local model state of one stage (built on meta and parallelised).

    ``stand_in`` maps every decoder layer of the stage, in order, to the built layer that stands for it
    (the stage was built with :func:`keep_layers` of :func:`stand_ins`); default: the layers built.
    ``layers_per_unit``: consecutive decoder layers that share one FSDP2 unit
    (``parallel.fsdp_layers_per_unit``; their gathered bytes are one unit's).
    """
    from plait.dist_core.fsdp_state import param_groups
    from torch.distributed.fsdp import FSDPModule

    layers = {ly.layer_idx: ly for ly in stage.decoder_layers()}  # type: ignore[operator]
    stand_in = stand_in or {i: i for i in layers}
    owner = {id(x): i for i, ly in layers.items() for x in (*ly.modules(), *ly.parameters())}
    moments, moment_dtype = _moments(optimizer)
    sums: dict[int | None, list[int]] = defaultdict(lambda: [0, 0, 0])  # per built layer; None: the rest
    for p in stage.parameters():
        local = _local(p)
        nbytes = local.numel() * local.element_size()
        acc = sums[owner.get(id(p))]
        acc[0] += nbytes
        if p.requires_grad:
            acc[1] += nbytes
            size = local.element_size() if moment_dtype is None else moment_dtype.itemsize
            acc[2] += moments * local.numel() * size
    # FSDP2 modules, innermost first: (the built layer holding it or None, whether it is that layer, bytes)
    units: list[tuple[int | None, bool, int]] = []
    owned: set[int] = set()
    for unit in reversed([m for m in stage.modules() if isinstance(m, FSDPModule)]):
        unit_bytes = 0  # a parameter belongs to the innermost unit holding it (not one that ignores it)
        managed = {id(fp.sharded_param) for group in param_groups(unit) for fp in group.fsdp_params}
        for p in unit.parameters():
            if id(p) in owned or id(p) not in managed or _gather_factor(p) == 1:
                continue
            owned.add(id(p))
            local = _local(p)
            unit_bytes += local.numel() * local.element_size() * _gather_factor(p)
        held = owner.get(id(unit))
        units.append((held, held is not None and unit is layers[held], unit_bytes))
    gathered: list[int] = []
    # units outside the layers that precede them in the modules' order (here after them: innermost first)
    leading, after_layers = 0, False
    for i, (layer, _, unit_bytes) in enumerate(units):
        if layer is None:
            gathered.append(unit_bytes)
            leading += unit_bytes if after_layers else 0
            continue
        if i == 0 or units[i - 1][0] is None:  # the layers' units, last first
            gathered += _layer_units(units, list(stand_in.values()), layers_per_unit)
        after_layers = True
    params, grads, opt = (sums[None][k] + sum(sums[stand_in[j]][k] for j in stand_in) for k in range(3))
    return StateBytes(params, grads, opt, tuple(gathered), sums[None][1], leading)


@dataclass(frozen=True)
class ActivationProfile:
    """Activation bytes of one microbatch, per decoder layer and at the model's ends, each as a pair
    (bytes of tensors as wide as the model, the other bytes: those tensor parallelism splits).

    Attributes:
        layers: what each decoder layer keeps for its backward, by global layer index.
        ends: what is kept outside the decoder layers: (embedding side, head and loss side).
        transient: the largest layer's activations unchecked: what a checkpointed layer holds while it is
            recomputed in the backward, and the unit the backward's other temporaries are measured in
            (``Machine.backward_scale``).
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
        self.bytes: SavedBytes = defaultdict(lambda: [0, 0])

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.record(str(func), out if isinstance(out, tuple | list) else (out,))
        return out

    def record(self, op: str, outputs: Sequence[Any]) -> None:
        """Count ``outputs`` of ``op`` on the current layer when the policy saves that op's outputs."""
        if op in self.ops and self.where[0] >= 0:
            for t in outputs:
                if isinstance(t, torch.Tensor):
                    _add(self.bytes[self.where[0]], t, self.hidden)


def _add(acc: list[int], t: torch.Tensor, hidden: int) -> None:
    acc[0 if t.dim() and t.shape[-1] == hidden else 1] += t.numel() * t.element_size()


class _FusedAttention(torch.autograd.Function):
    """What a fused attention kernel keeps for its backward (flash, cuDNN, FlexAttention: the inputs, the
    output and an fp32 log-sum-exp per query and head), in place of the ``[L, S]`` probabilities that
    SDPA's math path, the one meta tensors take, saves. Shapes only: the planner never runs a backward."""

    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        b, h, lq = q.shape[:3]  # [B, H, L, D]; the kernels write the output as [B, L, H, Dv], so that
        out = q.new_empty((b, lq, h, v.shape[-1])).transpose(1, 2)  # the head merge after is a view
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        return out, lse

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        raise NotImplementedError("the planner's attention stand-in has no backward")


_FUSED_ATTENTION_OP = "aten._scaled_dot_product_flash_attention.default"


@contextlib.contextmanager
def fused_attention(sac: _OpOutputs | None) -> Iterator[None]:
    """Attention as the GPU kernels save it (:class:`_FusedAttention`), for SDPA and the sink attention of
    ``plait.models``; its output and log-sum-exp count as the flash kernel's outputs for ``sac``."""
    from unittest import mock

    from plait.models.common.attention import kernels

    def attention(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        out, lse = _FusedAttention.apply(q, k, v)
        if sac is not None:
            sac.record(_FUSED_ATTENTION_OP, (out, lse))
        return out  # type: ignore[no-any-return]

    with (
        mock.patch.object(torch.nn.functional, "scaled_dot_product_attention", attention),
        mock.patch.object(kernels, "sink_reference_attention", attention),
    ):
        yield


def saved_bytes(
    model: nn.Module, seq: int, hidden: int, sac_ops: frozenset[str] | None = None
) -> tuple[SavedBytes, SavedBytes]:
    """One meta forward of ``model`` on one sample of ``seq`` tokens: saved bytes per layer index (each storage
    once; the parameters' storages, which saved weights and views of them share, not at all), and the bytes of
    ``sac_ops``' outputs per layer."""
    ids = torch.zeros(1, seq, dtype=torch.long, device="meta")
    where = [-1]
    saved: SavedBytes = defaultdict(lambda: [0, 0])
    # held: a freed storage's id would be reused. The parameters' own storages are in it from the start:
    # a saved view of a weight (a DTensor's local shard, a plain tensor under some torch versions) is no
    # activation.
    storages: dict[int, torch.UntypedStorage] = {
        id(st): st for p in model.parameters() for st in [_local(p).untyped_storage()]
    }
    handles = []
    for layer in model.decoder_layers():  # type: ignore[operator]
        handles.append(
            layer.register_forward_pre_hook(lambda m, a, i=layer.layer_idx: where.__setitem__(0, i))
        )
        handles.append(layer.register_forward_hook(lambda m, a, o: where.__setitem__(0, -2)))

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if id(storage) not in storages:
            storages[id(storage)] = storage
            _add(saved[where[0]], t, hidden)
        return t

    mode = _OpOutputs(sac_ops, where, hidden) if sac_ops else None
    try:
        with (
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
            mode or contextlib.nullcontext(),
            fused_attention(mode),
        ):
            model(input_ids=ids, labels=ids)
    finally:
        for h in handles:
            h.remove()
    return saved, mode.bytes if mode is not None else {}


def activation_profile(
    forward: Callable[[str], tuple[SavedBytes, SavedBytes]], mode: str, stand_in: Sequence[int]
) -> ActivationProfile:
    """Activation bytes of one sample under checkpointing ``mode``.

    ``forward(m)`` is :func:`saved_bytes` of the job's model with checkpointing ``m`` (``"none"``: with the
    outputs of the selective policy's ops; ``"full"``); decoder layer ``i`` is measured on ``stand_in[i]``.
    """

    def pair(d: SavedBytes, i: int) -> tuple[int, int]:
        v = d.get(i, [0, 0])
        return (v[0], v[1])

    plain, sac = forward("none")
    ends = (pair(plain, -1), pair(plain, -2))
    biggest = max((pair(plain, j) for j in stand_in), key=sum)
    if mode == "none":
        return ActivationProfile(tuple(pair(plain, j) for j in stand_in), ends, biggest)
    checked, _ = forward("full")
    kept = sac if mode == "selective" else {}
    per_layer = tuple(
        (pair(checked, j)[0] + pair(kept, j)[0], pair(checked, j)[1] + pair(kept, j)[1]) for j in stand_in
    )
    return ActivationProfile(per_layer, ends, biggest)
