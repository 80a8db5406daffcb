"""Convert expert weights between plait's layout and the input-major, gate/up-interleaved one.

plait's :class:`plait.moe.GroupedExperts` stores ``gate_up_proj`` ``[E, 2I, H]`` (output-major, gate
rows ``0..I-1`` then up rows ``I..2I-1``), ``down_proj`` ``[E, H, I]``, ``gate_up_proj_bias``
``[E, 2I]`` (gate half first) and ``down_proj_bias`` ``[E, H]``. Some checkpoints (transformers'
gpt-oss) store the experts input-major and interleave gate and up: ``gate_up_proj`` ``[E, H, 2I]``
with gate in columns ``0, 2, 4, ...`` and up in ``1, 3, 5, ...``, ``gate_up_proj_bias`` ``[E, 2I]``
interleaved the same way, ``down_proj`` ``[E, I, H]``, ``down_proj_bias`` ``[E, H]`` (as plait's).

Every function returns a new contiguous tensor; each ``*_to_*`` inverts its ``*_from_*`` exactly.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "deinterleave_halves",
    "down_from_input_major",
    "down_to_input_major",
    "gate_up_bias_from_interleaved",
    "gate_up_bias_to_interleaved",
    "gate_up_from_input_major_interleaved",
    "gate_up_to_input_major_interleaved",
    "interleave_halves",
    "interleaved_order",
]


def _check_even(t: Tensor, dim: int, who: str) -> None:
    if t.dim() == 0 or t.shape[dim] % 2:
        raise ValueError(f"{who}: dim {dim} of shape {tuple(t.shape)} must be even (2 * intermediate_size)")


def deinterleave_halves(t: Tensor, dim: int = -1) -> Tensor:
    """``[a0, b0, a1, b1, ...]`` -> ``[a0, a1, ..., b0, b1, ...]`` along ``dim``."""
    _check_even(t, dim, "deinterleave_halves")
    d = dim % t.dim()
    pairs = t.unflatten(d, (-1, 2))  # [..., I, 2, ...]: (a_i, b_i) side by side
    return torch.cat([pairs.select(d + 1, 0), pairs.select(d + 1, 1)], dim=d).contiguous()


def interleave_halves(t: Tensor, dim: int = -1) -> Tensor:
    """``[a0, a1, ..., b0, b1, ...]`` -> ``[a0, b0, a1, b1, ...]`` along ``dim`` (inverse of :func:`deinterleave_halves`)."""
    _check_even(t, dim, "interleave_halves")
    d = dim % t.dim()
    a, b = t.chunk(2, dim=d)
    return torch.stack([a, b], dim=d + 1).flatten(d, d + 1).contiguous()


def interleaved_order(intermediate_size: int) -> Tensor:
    """Index ``p`` (int64 ``[2I]``) with ``interleaved = halves[p]``: ``p = [0, I, 1, I+1, ...]``.

    Permutes any gate-first ``2I`` axis (e.g. an expert adapter's output rows) into the interleaved order.
    """
    half = torch.arange(intermediate_size)
    return torch.stack([half, half + intermediate_size], dim=1).flatten()


def gate_up_from_input_major_interleaved(w: Tensor) -> Tensor:
    """``[E, H, 2I]`` input-major, gate/up interleaved -> plait's ``[E, 2I, H]`` gate rows first.

    A transpose of the last two dims, then a de-interleave of the ``2I`` dim.
    """
    if w.dim() != 3:
        raise ValueError(f"gate_up_from_input_major_interleaved: expected [E, H, 2I], got {tuple(w.shape)}")
    return deinterleave_halves(w.transpose(1, 2), dim=1)


def gate_up_to_input_major_interleaved(w: Tensor) -> Tensor:
    """plait's ``[E, 2I, H]`` -> ``[E, H, 2I]`` input-major, gate/up interleaved."""
    if w.dim() != 3:
        raise ValueError(f"gate_up_to_input_major_interleaved: expected [E, 2I, H], got {tuple(w.shape)}")
    return interleave_halves(w, dim=1).transpose(1, 2).contiguous()


def gate_up_bias_from_interleaved(b: Tensor) -> Tensor:
    """``[E, 2I]`` gate/up interleaved -> plait's ``[E, 2I]`` gate half first."""
    return deinterleave_halves(b, dim=-1)


def gate_up_bias_to_interleaved(b: Tensor) -> Tensor:
    """plait's ``[E, 2I]`` gate half first -> gate/up interleaved."""
    return interleave_halves(b, dim=-1)


def down_from_input_major(w: Tensor) -> Tensor:
    """``[E, I, H]`` input-major -> plait's ``[E, H, I]`` (a transpose of the last two dims)."""
    if w.dim() != 3:
        raise ValueError(f"down_from_input_major: expected [E, I, H], got {tuple(w.shape)}")
    return w.transpose(1, 2).contiguous()


def down_to_input_major(w: Tensor) -> Tensor:
    """plait's ``[E, H, I]`` -> ``[E, I, H]`` input-major."""
    if w.dim() != 3:
        raise ValueError(f"down_to_input_major: expected [E, H, I], got {tuple(w.shape)}")
    return w.transpose(1, 2).contiguous()
