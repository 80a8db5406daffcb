"""Composite mappers: sequential chains (fusing groups), parallel side-by-side mappers, rank sharding."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

from ..errors import MapperError, format_keys
from ..specs import Region, TensorSpec
from .base import PASS_THROUGH, GroupFn, Mapper, MapperGroup

__all__ = ["Parallel", "RankShard", "Sequential"]


def _fuse(first: list[MapperGroup], second: list[MapperGroup]) -> list[MapperGroup]:
    """Fuse two consecutive layers of groups into connected components (one group each)."""
    producer = {k: i for i, g in enumerate(first) for k in g.outputs}
    parent = list(range(len(first)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    owner: list[int] = []
    for g in second:
        roots = [find(producer[k]) for k in g.inputs]
        for r in roots[1:]:
            parent[find(r)] = find(roots[0])
        owner.append(roots[0] if roots else -1)
    comps: dict[int, tuple[list[MapperGroup], list[MapperGroup]]] = {}
    for i, g in enumerate(first):
        comps.setdefault(find(i), ([], []))[0].append(g)
    for g, o in zip(second, owner):
        comps.setdefault(find(o) if o >= 0 else -1 - len(comps), ([], []))[1].append(g)
    return [_fused(a, b) for a, b in comps.values()]


def _fused(firsts: list[MapperGroup], seconds: list[MapperGroup]) -> MapperGroup:
    if not seconds and len(firsts) == 1:
        return firsts[0]
    if not firsts and len(seconds) == 1:
        return seconds[0]
    inputs = tuple(k for g in firsts for k in g.inputs)
    outputs = {k: s for g in seconds for k, s in g.outputs.items()}

    def chain(fns1: list[tuple[MapperGroup, GroupFn]], fns2: list[tuple[MapperGroup, GroupFn]]) -> GroupFn:
        def run(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            mid: dict[str, torch.Tensor] = {}
            for g, f in fns1:
                mid.update(f({k: t.pop(k) for k in g.inputs}))
            out: dict[str, torch.Tensor] = {}
            for g, f in fns2:
                out.update(f({k: mid.pop(k) for k in g.inputs}))
            return out

        return run

    fn = chain([(g, g.fn) for g in firsts], [(g, g.fn) for g in seconds])

    def slicer(regions: Mapping[str, Region | None]) -> tuple[dict[str, Region | None], GroupFn]:
        mid_regions: dict[str, Region | None] = {}
        fns2 = []
        for g in seconds:
            r, f = g.sliced(regions)
            mid_regions.update(r)
            fns2.append((g, f))
        in_regions: dict[str, Region | None] = {}
        fns1 = []
        for g in firsts:
            r, f = g.sliced(mid_regions)
            in_regions.update(r)
            fns1.append((g, f))
        return in_regions, chain(fns1, fns2)

    renames = None
    if all(g.renames is not None for g in (*firsts, *seconds)):
        inner = {o: i for g in firsts for o, i in (g.renames or {}).items()}
        renames = {o: inner[m] for g in seconds for o, m in (g.renames or {}).items()}
    labels = [g.label for g in (*firsts, *seconds)]
    label = (
        PASS_THROUGH
        if all(x == PASS_THROUGH for x in labels)
        else " -> ".join(dict.fromkeys(x for x in labels if x != PASS_THROUGH))
    )
    return MapperGroup(inputs, outputs, fn, slicer, renames, label)


class Sequential(Mapper):
    """Chains mappers: each one sees the keys the previous one produced.

    Groups are fused across stages into connected components, so a chain still streams one
    component at a time (e.g. rename, then stack experts: one group per stacked tensor). Also
    written ``m1 >> m2``.
    """

    def __init__(self, *mappers: Mapper) -> None:
        if not mappers:
            raise MapperError("Sequential needs at least one mapper")
        flat: list[Mapper] = []
        for m in mappers:
            flat.extend(m.mappers if isinstance(m, Sequential) else [m])
        self.mappers: list[Mapper] = flat

    def groups(self, source: Mapping[str, TensorSpec]) -> list[MapperGroup]:
        plan = self.mappers[0].plan(source)
        groups, specs = list(plan.groups), plan.outputs
        for m in self.mappers[1:]:
            nxt = m.plan(specs)
            groups, specs = _fuse(groups, list(nxt.groups)), nxt.outputs
        # Components that only passed keys through are not claimed (so Parallel can combine chains).
        return [g for g in groups if g.label != PASS_THROUGH]

    def inverse(self) -> Mapper:
        return Sequential(*(m.inverse() for m in reversed(self.mappers)))

    def __repr__(self) -> str:
        return "Sequential(" + ", ".join(repr(m) for m in self.mappers) + ")"


class Parallel(Mapper):
    """Runs mappers side by side on disjoint keys of the same source.

    Raises:
        MapperError: two mappers claim the same input key (the keys are listed).
    """

    def __init__(self, *mappers: Mapper) -> None:
        self.mappers = list(mappers)

    def groups(self, source: Mapping[str, TensorSpec]) -> list[MapperGroup]:
        out: list[MapperGroup] = []
        claimed: dict[str, int] = {}
        clash: set[str] = set()
        for i, m in enumerate(self.mappers):
            for g in m.groups(source):
                for k in g.inputs:
                    if k in claimed and claimed[k] != i:
                        clash.add(k)
                    claimed[k] = i
                out.append(g)
        if clash:
            raise MapperError(f"Parallel mappers claim the same keys: {format_keys(clash)}")
        return out

    def inverse(self) -> Mapper:
        return Parallel(*(m.inverse() for m in self.mappers))

    def __repr__(self) -> str:
        return "Parallel(" + ", ".join(repr(m) for m in self.mappers) + ")"


class RankShard(Mapper):
    """Keeps this rank's share of ``inner``'s groups (balanced by bytes read); drops the rest.

    Lets N processes convert one checkpoint in parallel: each runs ``RankShard(m, N, rank)`` and writes
    its outputs (see :func:`plait.model_state.convert_checkpoint`). Defaults come from
    ``torch.distributed`` when it is initialised (else one shard).
    """

    def __init__(self, inner: Mapper, num_shards: int | None = None, index: int | None = None) -> None:
        if num_shards is None:
            num_shards = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if index is None:
            index = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        if not 0 <= index < num_shards:
            raise MapperError(f"RankShard: index {index} out of range for {num_shards} shards")
        self.inner, self.num_shards, self.index = inner, num_shards, index

    def assignment(self, source: Mapping[str, TensorSpec]) -> list[tuple[MapperGroup, int]]:
        """Every group of ``inner``'s plan with the shard it goes to (greedy, largest first)."""
        groups = list(self.inner.plan(source).groups)
        size = [sum(source[k].nbytes for k in g.inputs) for g in groups]
        load = [0] * self.num_shards
        owner = [0] * len(groups)
        for i in sorted(range(len(groups)), key=lambda i: (-size[i], i)):
            s = min(range(self.num_shards), key=lambda j: (load[j], j))
            owner[i] = s
            load[s] += size[i]
        return list(zip(groups, owner))

    def groups(self, source: Mapping[str, TensorSpec]) -> list[MapperGroup]:
        mine: list[MapperGroup] = []
        others: list[str] = []
        for g, s in self.assignment(source):
            if s == self.index:
                mine.append(g)
            else:
                others.extend(g.inputs)
        return mine + (
            [MapperGroup.drop(others, f"RankShard({self.index}/{self.num_shards}): other ranks")]
            if others
            else []
        )

    def inverse(self) -> Mapper:
        return RankShard(self.inner.inverse(), self.num_shards, self.index)

    def __repr__(self) -> str:
        return f"RankShard({self.inner!r}, {self.index}/{self.num_shards})"
