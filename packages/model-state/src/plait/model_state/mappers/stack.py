"""Stack per-expert tensors into one grouped tensor, and the reverse."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..errors import MapperError, format_keys
from ..specs import TensorSpec
from .base import Mapper, MapperGroup, join_slicer
from .templates import KeyTemplate

__all__ = ["Stack", "Unstack"]


def _check_templates(many: KeyTemplate, one: KeyTemplate, over: str, who: str) -> None:
    if over not in many.fields:
        raise MapperError(f"{who}: template {many.template!r} lacks the index placeholder {{{over}}}")
    if over in one.fields:
        raise MapperError(f"{who}: template {one.template!r} must not contain {{{over}}}")
    if set(one.fields) != set(many.fields) - {over}:
        raise MapperError(f"{who}: templates {many.template!r} and {one.template!r} disagree on placeholders")


class Stack(Mapper):
    """Stacks ``inputs`` (indexed by placeholder ``over`` = 0..n-1) into ``output`` along new dim ``dim``.

    Example: ``Stack("layers.{i}.experts.{e}.w1", "layers.{i}.experts.w1", over="e")`` turns E tensors
    ``[I, H]`` into one ``[E, I, H]``. A consumer that wants only some experts (expert parallelism)
    gets only their bytes read.
    """

    def __init__(self, inputs: str, output: str, *, over: str, dim: int = 0) -> None:
        self.inputs, self.output = KeyTemplate(inputs), KeyTemplate(output)
        self.over, self.dim = over, dim
        _check_templates(self.inputs, self.output, over, repr(self))

    def groups(self, source: Mapping[str, TensorSpec]) -> list[MapperGroup]:
        buckets: dict[tuple[tuple[str, str], ...], dict[int, str]] = {}
        for k in source:
            m = self.inputs.match(k)
            if m is None:
                continue
            idx = m.pop(self.over)
            if not idx.isdigit():
                raise MapperError(f"{self!r}: key {k!r} has non-integer index {idx!r} for {{{self.over}}}")
            buckets.setdefault(tuple(sorted(m.items())), {})[int(idx)] = k
        groups = []
        for rest, by_idx in buckets.items():
            n = max(by_idx) + 1
            values = dict(rest)
            if len(by_idx) != n:
                gaps = [self.inputs.format({**values, self.over: i}) for i in range(n) if i not in by_idx]
                raise MapperError(f"{self!r}: missing inputs to stack: {format_keys(gaps)}")
            keys = [by_idx[i] for i in range(n)]
            specs = {source[k] for k in keys}
            if len(specs) != 1:
                detail = ", ".join(f"{k}: {source[k]}" for k in keys)
                raise MapperError(f"{self!r}: inputs differ in shape/dtype: {detail}")
            spec = specs.pop()
            dim = self.dim if self.dim >= 0 else self.dim + len(spec.shape) + 1
            out_key = self.output.format(values)
            out_spec = TensorSpec((*spec.shape[:dim], n, *spec.shape[dim:]), spec.dtype)
            groups.append(self._group(keys, out_key, out_spec, dim))
        return groups

    def _group(self, keys: list[str], out_key: str, out_spec: TensorSpec, dim: int) -> MapperGroup:
        def fn(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            return {out_key: torch.stack([t[k] for k in keys], dim)}

        slicer = join_slicer(keys, out_key, dim, None, fn)
        return MapperGroup(tuple(keys), {out_key: out_spec}, fn, slicer, None, repr(self))

    def inverse(self) -> Mapper:
        return Unstack(self.output.template, self.inputs.template, over=self.over, dim=self.dim)

    def __repr__(self) -> str:
        return (
            f"Stack({self.inputs.template!r} -> {self.output.template!r}, over={self.over!r}, dim={self.dim})"
        )


class Unstack(Mapper):
    """Splits ``input`` along ``dim`` into ``outputs`` indexed by placeholder ``over`` (inverse of Stack)."""

    def __init__(self, input: str, outputs: str, *, over: str, dim: int = 0) -> None:
        self.input, self.outputs = KeyTemplate(input), KeyTemplate(outputs)
        self.over, self.dim = over, dim
        _check_templates(self.outputs, self.input, over, repr(self))

    def groups(self, source: Mapping[str, TensorSpec]) -> list[MapperGroup]:
        groups = []
        for k, spec in source.items():
            m = self.input.match(k)
            if m is None:
                continue
            if not spec.shape:
                raise MapperError(f"{self!r}: cannot unstack scalar {k!r}")
            dim = self.dim % len(spec.shape)
            n = spec.shape[dim]
            outs = [self.outputs.format({**m, self.over: i}) for i in range(n)]
            out_spec = TensorSpec(spec.shape[:dim] + spec.shape[dim + 1 :], spec.dtype)
            groups.append(self._group(k, outs, out_spec, dim))
        return groups

    def _group(self, key: str, outs: list[str], out_spec: TensorSpec, dim: int) -> MapperGroup:
        def fn(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            return dict(zip(outs, t[key].unbind(dim)))

        return MapperGroup((key,), dict.fromkeys(outs, out_spec), fn, None, None, repr(self))

    def inverse(self) -> Mapper:
        return Stack(self.outputs.template, self.input.template, over=self.over, dim=self.dim)

    def __repr__(self) -> str:
        return f"Unstack({self.input.template!r} -> {self.outputs.template!r}, over={self.over!r}, dim={self.dim})"
