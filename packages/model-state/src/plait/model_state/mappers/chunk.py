"""Split one tensor into parts (qkv -> q, k, v) and concatenate parts into one (gate, up -> gate_up)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from ..errors import MapperError, format_keys
from ..specs import TensorSpec
from .base import Mapper, MapperGroup, join_slicer
from .templates import KeyTemplate

__all__ = ["Chunk", "Concatenate"]


def _same_fields(templates: Sequence[KeyTemplate], who: str) -> None:
    fields = {frozenset(t.fields) for t in templates}
    if len(fields) != 1:
        raise MapperError(f"{who}: templates {[t.template for t in templates]} disagree on placeholders")


class Chunk(Mapper):
    """Splits ``input`` along ``dim`` into ``outputs`` (equal parts, or ``sizes``).

    Example: ``Chunk("layers.{i}.mlp.gate_up.weight", ["layers.{i}.mlp.gate.weight",
    "layers.{i}.mlp.up.weight"], dim=0)``.
    """

    def __init__(
        self, input: str, outputs: Sequence[str], *, dim: int = 0, sizes: Sequence[int] | None = None
    ) -> None:
        self.input = KeyTemplate(input)
        self.outputs = [KeyTemplate(o) for o in outputs]
        self.dim = dim
        self.sizes = None if sizes is None else [int(s) for s in sizes]
        _same_fields([self.input, *self.outputs], repr(self))
        if self.sizes is not None and len(self.sizes) != len(self.outputs):
            raise MapperError(f"{self!r}: {len(self.sizes)} sizes for {len(self.outputs)} outputs")

    def groups(self, source: Mapping[str, TensorSpec]) -> list[MapperGroup]:
        groups = []
        for k, spec in source.items():
            m = self.input.match(k)
            if m is None:
                continue
            dim = self.dim % len(spec.shape)
            total = spec.shape[dim]
            if self.sizes is None:
                if total % len(self.outputs):
                    raise MapperError(
                        f"{self!r}: {k!r} has size {total} on dim {dim}, not divisible by {len(self.outputs)}"
                    )
                sizes = [total // len(self.outputs)] * len(self.outputs)
            else:
                sizes = self.sizes
                if sum(sizes) != total:
                    raise MapperError(
                        f"{self!r}: sizes {sizes} do not add up to {k!r}'s {total} on dim {dim}"
                    )
            outs = [o.format(m) for o in self.outputs]
            specs = {
                o: TensorSpec((*spec.shape[:dim], s, *spec.shape[dim + 1 :]), spec.dtype)
                for o, s in zip(outs, sizes)
            }
            groups.append(self._group(k, outs, specs, sizes, dim))
        return groups

    def _group(
        self, key: str, outs: list[str], specs: dict[str, TensorSpec], sizes: list[int], dim: int
    ) -> MapperGroup:
        def fn(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            return dict(zip(outs, torch.split(t[key], sizes, dim)))

        return MapperGroup((key,), specs, fn, None, None, repr(self))

    def inverse(self) -> Mapper:
        return Concatenate(
            [o.template for o in self.outputs], self.input.template, dim=self.dim, sizes=self.sizes
        )

    def __repr__(self) -> str:
        return f"Chunk({self.input.template!r} -> {[o.template for o in self.outputs]}, dim={self.dim})"


class Concatenate(Mapper):
    """Concatenates ``inputs`` along ``dim`` into ``output`` (q, k, v -> qkv; gate, up -> gate_up).

    The first input template drives matching; the others are filled from its placeholders and must
    exist. A consumer wanting a region of the output reads only the overlapping parts of each input.
    ``sizes`` (optional) is checked against the inputs and lets :meth:`inverse` split unequal parts.
    """

    def __init__(
        self, inputs: Sequence[str], output: str, *, dim: int = 0, sizes: Sequence[int] | None = None
    ) -> None:
        self.inputs = [KeyTemplate(i) for i in inputs]
        self.output = KeyTemplate(output)
        self.dim = dim
        self.sizes = None if sizes is None else [int(s) for s in sizes]
        _same_fields([self.output, *self.inputs], repr(self))

    def groups(self, source: Mapping[str, TensorSpec]) -> list[MapperGroup]:
        groups = []
        for k in source:
            m = self.inputs[0].match(k)
            if m is None:
                continue
            keys = [t.format(m) for t in self.inputs]
            absent = [x for x in keys if x not in source]
            if absent:
                raise MapperError(f"{self!r}: missing inputs to concatenate: {format_keys(absent)}")
            specs = [source[x] for x in keys]
            ndim = len(specs[0].shape)
            dim = self.dim % ndim
            ok = all(
                len(s.shape) == ndim
                and s.dtype == specs[0].dtype
                and s.shape[:dim] + s.shape[dim + 1 :] == specs[0].shape[:dim] + specs[0].shape[dim + 1 :]
                for s in specs
            )
            if not ok:
                raise MapperError(
                    f"{self!r}: inputs cannot be concatenated on dim {dim}: "
                    + ", ".join(f"{x}: {s}" for x, s in zip(keys, specs))
                )
            sizes = [s.shape[dim] for s in specs]
            if self.sizes is not None and sizes != self.sizes:
                raise MapperError(
                    f"{self!r}: inputs {keys} have sizes {sizes} on dim {dim}, expected {self.sizes}"
                )
            shape = list(specs[0].shape)
            shape[dim] = sum(sizes)
            groups.append(
                self._group(keys, self.output.format(m), TensorSpec(tuple(shape), specs[0].dtype), sizes, dim)
            )
        return groups

    def _group(self, keys: list[str], out: str, spec: TensorSpec, sizes: list[int], dim: int) -> MapperGroup:
        def fn(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            return {out: torch.cat([t[k] for k in keys], dim)}

        slicer = join_slicer(keys, out, dim, sizes, fn)
        return MapperGroup(tuple(keys), {out: spec}, fn, slicer, None, repr(self))

    def inverse(self) -> Mapper:
        return Chunk(self.output.template, [i.template for i in self.inputs], dim=self.dim, sizes=self.sizes)

    def __repr__(self) -> str:
        return f"Concatenate({[i.template for i in self.inputs]} -> {self.output.template!r}, dim={self.dim})"
