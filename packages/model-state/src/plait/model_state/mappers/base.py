"""The mapper protocol: dependency groups declared before reading, applied one group at a time."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..errors import KeyMismatchError, MapperError, SpecMismatchError, format_keys
from ..specs import Region, TensorSpec, slice_region
from .templates import as_templates, match_any

if TYPE_CHECKING:
    from .composite import Sequential

__all__ = [
    "GroupFn",
    "KeyReport",
    "Mapper",
    "MapperGroup",
    "Plan",
    "Slicer",
    "join_slicer",
    "plan_groups",
    "rekey",
]

PASS_THROUGH = "pass-through"
"""Label of the identity groups a plan adds for keys no mapper claims."""

GroupFn = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]
"""Transforms one group's input tensors (by key) into its output tensors (by key)."""

Slicer = Callable[[Mapping[str, "Region | None"]], tuple[dict[str, "Region | None"], GroupFn]]
"""Given the region wanted of each output (``None``: all of it), return the region to read of each
input and the function that turns exactly those input regions into exactly those output regions."""


@dataclass(frozen=True, eq=False)
class MapperGroup:
    """One independent unit of a mapper graph: these input keys produce those output keys.

    Groups are declared from tensor specs alone, before any byte is read, so a reader can stream a
    checkpoint group by group and validation can run up front.

    Attributes:
        inputs: source keys the group reads (ordered).
        outputs: spec of every key the group produces (ordered). Empty for a group that drops keys.
        fn: the transformation on full tensors.
        slicer: optional; lets a consumer ask for a region of each output so that only the matching
            bytes of the inputs are read (see :data:`Slicer`). Without it inputs are read whole.
        renames: ``output -> input`` when the group only renames (the data is untouched).
        label: the mapper that made the group, for error messages.
    """

    inputs: tuple[str, ...]
    outputs: Mapping[str, TensorSpec]
    fn: GroupFn
    slicer: Slicer | None = None
    renames: Mapping[str, str] | None = None
    label: str = ""

    @property
    def input_keys(self) -> frozenset[str]:
        return frozenset(self.inputs)

    @property
    def output_keys(self) -> frozenset[str]:
        return frozenset(self.outputs)

    @classmethod
    def rename(cls, src: str, dst: str, spec: TensorSpec, label: str = "identity") -> MapperGroup:
        """A group that exposes ``src`` as ``dst`` unchanged (slices pass straight through)."""

        def fn(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            return {dst: t[src]}

        def slicer(regions: Mapping[str, Region | None]) -> tuple[dict[str, Region | None], GroupFn]:
            return {src: regions.get(dst)}, fn

        return cls((src,), {dst: spec}, fn, slicer, {dst: src}, label)

    @classmethod
    def drop(cls, keys: Iterable[str], label: str = "drop") -> MapperGroup:
        """A group that consumes ``keys`` and produces nothing (they are never read)."""
        return cls(tuple(keys), {}, lambda t: {}, None, None, label)

    def sliced(
        self, out_regions: Mapping[str, Region | None] | None = None
    ) -> tuple[dict[str, Region | None], GroupFn]:
        """Input regions to read and the function producing the requested output regions."""
        regions = {k: (out_regions or {}).get(k) for k in self.outputs}
        if self.slicer is not None:
            in_regions, fn = self.slicer(regions)
            return {k: in_regions.get(k) for k in self.inputs}, fn
        if all(r is None for r in regions.values()):
            return dict.fromkeys(self.inputs), self.fn

        def full_then_slice(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            out = self.fn(t)
            return {k: slice_region(v, regions.get(k)) for k, v in out.items()}

        return dict.fromkeys(self.inputs), full_then_slice

    def __repr__(self) -> str:
        return f"MapperGroup({self.label}: {list(self.inputs)} -> {list(self.outputs)})"


@dataclass(frozen=True)
class KeyReport:
    """Result of checking a plan's outputs against a target's keys."""

    missing: tuple[str, ...] = ()
    unexpected: tuple[str, ...] = ()


@dataclass(frozen=True)
class Plan:
    """A validated, complete mapper graph over concrete source specs.

    Every source key is read by exactly one group (keys no mapper claims pass through unchanged) and
    every output key is produced by exactly one group.
    """

    source: Mapping[str, TensorSpec]
    groups: tuple[MapperGroup, ...]
    outputs: Mapping[str, TensorSpec] = field(default_factory=dict)

    def producer(self, key: str) -> MapperGroup:
        """The group that produces output ``key``."""
        for g in self.groups:
            if key in g.outputs:
                return g
        raise KeyError(f"no group produces {key!r}")

    def check(
        self,
        target: Mapping[str, TensorSpec],
        *,
        strict: bool = True,
        check_dtype: bool = True,
        what: str = "module",
    ) -> KeyReport:
        """Compare the plan's outputs with the keys, shapes and dtypes a target expects.

        Args:
            target: expected specs (e.g. a module's state dict specs).
            strict: raise :class:`KeyMismatchError` on missing or unexpected keys; otherwise report them.
            check_dtype: raise on dtype differences too (shape differences always raise).
            what: name of the target in messages.

        Raises:
            KeyMismatchError: missing/unexpected keys in strict mode (both lists in the message).
            SpecMismatchError: shapes (or dtypes) differ for keys present on both sides.
        """
        missing = sorted(set(target) - set(self.outputs))
        unexpected = sorted(set(self.outputs) - set(target))
        if strict and (missing or unexpected):
            lines = [f"checkpoint keys (after mapping) do not match the {what}:"]
            if missing:
                lines.append(f"  missing from checkpoint ({len(missing)}): {format_keys(missing)}")
            if unexpected:
                lines.append(f"  unexpected in checkpoint ({len(unexpected)}): {format_keys(unexpected)}")
            raise KeyMismatchError("\n".join(lines), missing, unexpected)
        bad = []
        for k in sorted(set(target) & set(self.outputs)):
            a, b = self.outputs[k], target[k]
            if a.shape != b.shape or (check_dtype and a.dtype != b.dtype):
                bad.append(f"  {k!r}: checkpoint {a} vs {what} {b}")
        if bad:
            head = (
                f"{len(bad)} tensor(s) differ in shape{' or dtype' if check_dtype else ''} from the {what}:"
            )
            raise SpecMismatchError("\n".join([head, *bad[:25]]) + ("\n  ..." if len(bad) > 25 else ""))
        return KeyReport(tuple(missing), tuple(unexpected))


def plan_groups(groups: Iterable[MapperGroup], source: Mapping[str, TensorSpec]) -> Plan:
    """Validate claimed groups against ``source`` and complete them with pass-through groups.

    Raises:
        MapperError: a group reads keys the source lacks, a key is read by two groups, or two groups
            produce the same key (each message lists the keys).
    """
    groups = list(groups)
    absent: dict[str, list[str]] = {}
    readers: dict[str, MapperGroup] = {}
    twice: set[str] = set()
    for g in groups:
        for k in g.inputs:
            if k not in source:
                absent.setdefault(g.label, []).append(k)
            if k in readers:
                twice.add(k)
            readers[k] = g
    if absent:
        lines = [f"  {label}: {format_keys(keys)}" for label, keys in absent.items()]
        raise MapperError("mapper inputs that the source does not provide:\n" + "\n".join(lines))
    if twice:
        raise MapperError(f"keys read by more than one mapper group: {format_keys(twice)}")
    for k, spec in source.items():
        if k not in readers:
            groups.append(MapperGroup.rename(k, k, spec, PASS_THROUGH))
    outputs: dict[str, TensorSpec] = {}
    overlap: set[str] = set()
    for g in groups:
        for k, spec in g.outputs.items():
            if k in outputs:
                overlap.add(k)
            outputs[k] = spec
    if overlap:
        raise MapperError(
            f"overlapping outputs: keys produced by more than one mapper group: {format_keys(overlap)}"
        )
    return Plan(dict(source), tuple(groups), outputs)


class Mapper(ABC):
    """Base of every mapper: a declarative key/tensor transformation.

    Subclasses implement :meth:`groups`, which returns the groups for the source keys the mapper
    claims; keys it does not claim pass through unchanged. :meth:`plan` validates and completes them.
    """

    @abstractmethod
    def groups(self, source: Mapping[str, TensorSpec]) -> list[MapperGroup]:
        """Groups for the keys of ``source`` this mapper transforms (specs only; nothing is read)."""

    def plan(self, source: Mapping[str, TensorSpec]) -> Plan:
        """Validated, complete plan over ``source`` (unclaimed keys pass through)."""
        return plan_groups(self.groups(source), source)

    def apply(self, group: MapperGroup, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Run one group on full input tensors."""
        return group.fn(tensors)

    def map_state(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Apply the whole mapper to an in-memory state dict (convenience; holds everything)."""
        plan = self.plan({k: TensorSpec.of(v) for k, v in state.items()})
        out: dict[str, torch.Tensor] = {}
        for g in plan.groups:
            out.update(self.apply(g, {k: state[k] for k in g.inputs}))
        return out

    def inverse(self) -> Mapper:
        """The mapper that undoes this one.

        Raises:
            MapperError: the mapper is not invertible (or lacks the information to invert).
        """
        raise MapperError(f"{type(self).__name__} has no inverse")

    def __rshift__(self, other: Mapper) -> Sequential:
        from .composite import Sequential

        return Sequential(self, other)


def rekey(
    group: MapperGroup, in_names: Mapping[str, str], out_names: Mapping[str, str], label: str = ""
) -> MapperGroup:
    """The same group under other key names (``in_names``/``out_names``: inner name -> outer name)."""
    in_inv = {v: k for k, v in in_names.items()}
    out_inv = {v: k for k, v in out_names.items()}

    def wrap(fn: GroupFn) -> GroupFn:
        def run(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            out = fn({in_inv[k]: v for k, v in t.items()})
            return {out_names[k]: v for k, v in out.items()}

        return run

    def slicer(regions: Mapping[str, Region | None]) -> tuple[dict[str, Region | None], GroupFn]:
        in_regions, fn = group.sliced({out_inv[k]: r for k, r in regions.items()})
        return {in_names[k]: r for k, r in in_regions.items()}, wrap(fn)

    renames = None
    if group.renames is not None:
        renames = {out_names[o]: in_names[i] for o, i in group.renames.items()}
    return MapperGroup(
        tuple(in_names[k] for k in group.inputs),
        {out_names[k]: s for k, s in group.outputs.items()},
        wrap(group.fn),
        slicer,
        renames,
        label or group.label,
    )


def join_slicer(keys: Sequence[str], out: str, dim: int, sizes: Sequence[int] | None, fn: GroupFn) -> Slicer:
    """The slicer of a group whose ``fn`` joins ``keys`` along ``dim`` into ``out``.

    Args:
        keys: the inputs, in joining order.
        out: the output key.
        dim: the joining dim of ``out``.
        sizes: the inputs' lengths on ``dim`` when they are concatenated; None when they are stacked
            on a new dim ``dim`` (one index each).
        fn: the join of the whole inputs.

    Each input is read only where it overlaps the region wanted of ``out``; an input outside that
    region is read empty (and, when stacking, left out of the stack).
    """
    stacked = sizes is None
    lengths = [1] * len(keys) if sizes is None else list(sizes)

    def slicer(regions: Mapping[str, Region | None]) -> tuple[dict[str, Region | None], GroupFn]:
        r = regions.get(out)
        if r is None:
            return dict.fromkeys(keys), fn
        a, b = r[dim]
        before, after = r[:dim], r[dim + 1 :]
        in_regions: dict[str, Region | None] = {}
        hit: list[str] = []
        offset = 0
        for k, n in zip(keys, lengths):
            lo, hi = max(a - offset, 0), min(b - offset, n)
            offset += n
            if hi > lo:
                hit.append(k)
            else:
                lo = hi = 0
            if not stacked:
                in_regions[k] = (*before, (lo, hi), *after)
            elif hi > lo:
                in_regions[k] = before + after
            else:
                in_regions[k] = tuple((0, 0) for _ in before + after)
        if not stacked:
            return in_regions, fn  # the empty parts add nothing to the concatenation

        def part(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            return {out: torch.stack([t[k] for k in hit], dim)}

        return in_regions, part

    return slicer


Keys = str | Sequence[str]


class _PerTensor(Mapper):
    """Base for mappers that map each matching tensor on its own, keeping its key (``_group`` returns
    None to leave one out)."""

    def __init__(self, keys: Keys) -> None:
        self.keys = [keys] if isinstance(keys, str) else list(keys)
        self.templates = as_templates(self.keys)

    def groups(self, source: Mapping[str, TensorSpec]) -> list[MapperGroup]:
        out = []
        for k, spec in source.items():
            if match_any(self.templates, k) is None:
                continue
            group = self._group(k, spec)
            if group is not None:
                out.append(group)
        return out

    def _group(self, key: str, spec: TensorSpec) -> MapperGroup | None:
        raise NotImplementedError
