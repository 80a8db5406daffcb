"""Per-tensor mappers that keep the key: transpose, reshape, dtype cast, (de-)interleave."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from ..errors import MapperError
from ..specs import Region, TensorSpec
from .base import GroupFn, Keys, Mapper, MapperGroup, _PerTensor

__all__ = ["Cast", "Deinterleave", "Interleave", "Reshape", "Transpose"]


class Transpose(_PerTensor):
    """Swaps dims ``dim0`` and ``dim1`` of the matching tensors (result is contiguous); self-inverse."""

    def __init__(self, keys: Keys, dim0: int = 0, dim1: int = 1) -> None:
        super().__init__(keys)
        self.dim0, self.dim1 = dim0, dim1

    def _group(self, key: str, spec: TensorSpec) -> MapperGroup:
        nd = len(spec.shape)
        if not (-nd <= self.dim0 < nd and -nd <= self.dim1 < nd):
            raise MapperError(f"{self!r}: {key!r} has {nd} dims")
        d0, d1 = self.dim0 % nd, self.dim1 % nd
        shape = list(spec.shape)
        shape[d0], shape[d1] = shape[d1], shape[d0]

        def fn(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            return {key: t[key].transpose(d0, d1).contiguous()}

        def slicer(regions: Mapping[str, Region | None]) -> tuple[dict[str, Region | None], GroupFn]:
            r = regions.get(key)
            if r is None:
                return {key: None}, fn
            rr = list(r)
            rr[d0], rr[d1] = rr[d1], rr[d0]
            return {key: tuple(rr)}, fn

        return MapperGroup((key,), {key: TensorSpec(tuple(shape), spec.dtype)}, fn, slicer, None, repr(self))

    def inverse(self) -> Mapper:
        return self

    def __repr__(self) -> str:
        return f"Transpose({self.keys}, {self.dim0}, {self.dim1})"


class Reshape(_PerTensor):
    """Reshapes the matching tensors to ``shape`` (``-1`` allowed).

    ``from_shape`` (optional; ``-1`` matches any size) restricts the mapper to tensors of that shape
    and makes it invertible.
    """

    def __init__(self, keys: Keys, shape: Sequence[int], from_shape: Sequence[int] | None = None) -> None:
        super().__init__(keys)
        self.shape = tuple(int(s) for s in shape)
        self.from_shape = None if from_shape is None else tuple(int(s) for s in from_shape)

    def _group(self, key: str, spec: TensorSpec) -> MapperGroup | None:
        if self.from_shape is not None and not (
            len(spec.shape) == len(self.from_shape)
            and all(f in (-1, s) for f, s in zip(self.from_shape, spec.shape))
        ):
            return None
        try:
            shape = tuple(torch.empty(spec.shape, device="meta").reshape(self.shape).shape)
        except RuntimeError as e:
            raise MapperError(f"{self!r}: cannot reshape {key!r} {spec} to {list(self.shape)}: {e}") from None

        def fn(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            return {key: t[key].reshape(shape)}

        return MapperGroup((key,), {key: TensorSpec(shape, spec.dtype)}, fn, None, None, repr(self))

    def inverse(self) -> Mapper:
        if self.from_shape is None:
            raise MapperError(f"{self!r} needs from_shape to be inverted")
        return Reshape(self.keys, self.from_shape, self.shape)

    def __repr__(self) -> str:
        return f"Reshape({self.keys}, {list(self.shape)})"


class Cast(_PerTensor):
    """Casts the matching tensors to ``dtype``.

    ``from_dtype`` (optional) restricts the cast to tensors of that dtype and makes it invertible
    (e.g. ``Cast(torch.bfloat16, from_dtype=torch.float32)`` leaves integer buffers alone).
    """

    def __init__(
        self, dtype: torch.dtype, keys: Keys = "{*key}", from_dtype: torch.dtype | None = None
    ) -> None:
        super().__init__(keys)
        self.dtype, self.from_dtype = dtype, from_dtype

    def _group(self, key: str, spec: TensorSpec) -> MapperGroup | None:
        if self.from_dtype is not None and spec.dtype != self.from_dtype:
            return None
        dtype = self.dtype

        def fn(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            return {key: t[key].to(dtype)}

        def slicer(regions: Mapping[str, Region | None]) -> tuple[dict[str, Region | None], GroupFn]:
            return {key: regions.get(key)}, fn

        return MapperGroup((key,), {key: TensorSpec(spec.shape, dtype)}, fn, slicer, None, repr(self))

    def inverse(self) -> Mapper:
        if self.from_dtype is None:
            raise MapperError(f"{self!r} needs from_dtype to be inverted")
        return Cast(self.from_dtype, self.keys, self.dtype)

    def __repr__(self) -> str:
        return f"Cast({self.dtype}, {self.keys})"


class _Interleaving(_PerTensor):
    """Reorders dim ``dim`` of the matching tensors between ``parts`` interleaved and contiguous parts."""

    interleaved_in: bool

    def __init__(self, keys: Keys, dim: int = -1, parts: int = 2) -> None:
        super().__init__(keys)
        if parts < 2:
            raise MapperError(f"{type(self).__name__}: parts must be >= 2, got {parts}")
        self.dim, self.parts = dim, parts

    def _group(self, key: str, spec: TensorSpec) -> MapperGroup:
        nd = len(spec.shape)
        if not -nd <= self.dim < nd:
            raise MapperError(f"{self!r}: {key!r} has {nd} dims")
        d, parts = self.dim % nd, self.parts
        if spec.shape[d] % parts:
            raise MapperError(f"{self!r}: dim {d} of {key!r} {list(spec.shape)} is not divisible by {parts}")
        split = (-1, parts) if self.interleaved_in else (parts, -1)
        src, dst = (d + 1, d) if self.interleaved_in else (d, d + 1)

        def fn(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            return {key: t[key].unflatten(d, split).movedim(src, dst).flatten(d, d + 1).contiguous()}

        return MapperGroup((key,), {key: spec}, fn, None, None, repr(self))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.keys}, dim={self.dim}, parts={self.parts})"


class Deinterleave(_Interleaving):
    """``[a0, b0, a1, b1, ...]`` -> ``[a0, a1, ..., b0, b1, ...]`` along ``dim`` (``parts`` = 2 here).

    E.g. a gate/up-interleaved fused projection (gpt-oss's ``gate_up_proj``) to gate-half-first.
    Reads whole tensors (no region slicing).
    """

    interleaved_in = True

    def inverse(self) -> Mapper:
        return Interleave(self.keys, self.dim, self.parts)


class Interleave(_Interleaving):
    """``[a0, a1, ..., b0, b1, ...]`` -> ``[a0, b0, a1, b1, ...]`` along ``dim``; inverse of :class:`Deinterleave`."""

    interleaved_in = False

    def inverse(self) -> Mapper:
        return Deinterleave(self.keys, self.dim, self.parts)
