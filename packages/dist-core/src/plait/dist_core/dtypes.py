"""One way to turn a dtype's name into a ``torch.dtype`` (configs, wire metadata, checkpoints)."""

from __future__ import annotations

import torch

__all__ = ["dtype_name", "parse_dtype"]

# Every torch dtype by its canonical name ("bfloat16"): str(torch.bfloat16) without "torch.".
_BY_NAME: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)
}


def parse_dtype(name: str) -> torch.dtype:
    """The ``torch.dtype`` named ``name``: ``"bfloat16"`` or ``"torch.bfloat16"`` (``str(dtype)``).

    Raises:
        ValueError: ``name`` is not a torch dtype's canonical name (aliases like ``"bf16"`` or
            ``"float"`` are refused, so a config says exactly one thing).
    """
    dtype = _BY_NAME.get(name.removeprefix("torch.")) if isinstance(name, str) else None
    if dtype is None:
        raise ValueError(
            f"unknown dtype {name!r}; expected a torch dtype name such as 'bfloat16' or 'float32'"
        )
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    """The canonical name of ``dtype`` (``"bfloat16"``), which :func:`parse_dtype` reads back."""
    return str(dtype).removeprefix("torch.")
