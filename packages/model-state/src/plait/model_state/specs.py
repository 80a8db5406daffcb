"""Tensor metadata records (shape, dtype) and region (box slice) helpers."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["Region", "TensorSpec", "dtype_from_safetensors", "dtype_to_safetensors"]

Region = tuple[tuple[int, int], ...]
"""A box inside a tensor: one ``(start, stop)`` pair per dimension."""

_ST_TO_TORCH: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
    "C64": torch.complex64,
}
_TORCH_TO_ST = {v: k for k, v in _ST_TO_TORCH.items()}


def dtype_from_safetensors(name: str) -> torch.dtype:
    """Map a safetensors dtype string (``"BF16"``) to a torch dtype."""
    try:
        return _ST_TO_TORCH[name]
    except KeyError:
        raise ValueError(f"unsupported safetensors dtype {name!r}") from None


def dtype_to_safetensors(dtype: torch.dtype) -> str:
    """Map a torch dtype to its safetensors dtype string."""
    try:
        return _TORCH_TO_ST[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} cannot be stored in safetensors") from None


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of a (global) tensor, known before any byte is read."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorSpec:
        """Spec of a tensor; a DTensor reports its global shape."""
        return cls(tuple(int(s) for s in tensor.shape), tensor.dtype)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def __str__(self) -> str:
        return f"{str(self.dtype).removeprefix('torch.')}{list(self.shape)}"


def full_region(shape: Sequence[int]) -> Region:
    return tuple((0, int(s)) for s in shape)


def region_shape(region: Region) -> tuple[int, ...]:
    return tuple(stop - start for start, stop in region)


def is_full(region: Region | None, shape: Sequence[int]) -> bool:
    return region is None or tuple(region) == full_region(shape)


def slice_region(tensor: torch.Tensor, region: Region | None) -> torch.Tensor:
    """View of ``tensor`` restricted to ``region`` (``None``: the whole tensor)."""
    if region is None:
        return tensor
    return tensor[tuple(slice(a, b) for a, b in region)]
