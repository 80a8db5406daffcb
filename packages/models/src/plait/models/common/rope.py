"""Rotary position embeddings: default, linear, dynamic-NTK, YaRN and Llama 3, with partial rotary.

The frequency formulas follow ``transformers.modeling_rope_utils`` so converted checkpoints
produce the same cos/sin tables. Tables are computed per forward from ``position_ids`` (no
buffers), so modules built on the meta device need no re-initialisation.
"""

from __future__ import annotations

import math

import torch
from plait.models.common.config import RopeParameters
from torch import nn

__all__ = ["RotaryEmbedding", "apply_rotary", "rope_inv_freq"]


def rope_inv_freq(
    params: RopeParameters,
    head_dim: int,
    max_position_embeddings: int,
    seq_len: int | None = None,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the cos/sin scale (``attention_factor``) for a RoPE variant.

    Args:
        params: RoPE parameters.
        head_dim: Per-head width; ``int(head_dim * partial_rotary_factor)`` dims are rotated.
        max_position_embeddings: Model context length (dynamic NTK grows the base beyond it).
        seq_len: Current sequence length (dynamic NTK only).
        device: Device of the returned tensor.

    Returns:
        ``(inv_freq [rot_dim // 2] fp32, attention_factor)``.
    """
    dim = int(head_dim * params.partial_rotary_factor)
    base = params.rope_theta
    exps = torch.arange(0, dim, 2, dtype=torch.int64, device=device).to(torch.float) / dim
    if params.rope_type == "default":
        return 1.0 / (base**exps), 1.0
    if params.rope_type == "linear":
        assert params.factor is not None
        return (1.0 / (base**exps)) / params.factor, 1.0
    if params.rope_type == "dynamic":
        assert params.factor is not None
        n = max(seq_len or max_position_embeddings, max_position_embeddings)
        f = params.factor
        base = base * ((f * n / max_position_embeddings) - (f - 1)) ** (dim / (dim - 2))
        return 1.0 / (base**exps), 1.0
    if params.rope_type == "llama3":
        return _frequency_band_inv_freq(params, 1.0 / (base**exps)), 1.0
    # yarn
    orig = params.original_max_position_embeddings
    assert orig is not None
    factor = params.factor if params.factor is not None else max_position_embeddings / orig

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = params.attention_factor
    if attention_factor is None:
        if params.mscale and params.mscale_all_dim:
            attention_factor = get_mscale(factor, params.mscale) / get_mscale(factor, params.mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)
    beta_fast = params.beta_fast or 32
    beta_slow = params.beta_slow or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(orig / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp(
        (torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low), 0, 1
    )
    pos_freqs = base ** (torch.arange(0, dim, 2, device=device).to(torch.float) / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def _frequency_band_inv_freq(params: RopeParameters, inv_freq: torch.Tensor) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by ``factor``, short ones kept, a smooth ramp between."""
    factor, orig = params.factor, params.original_max_position_embeddings
    low, high = params.low_freq_factor, params.high_freq_factor
    assert factor is not None and orig is not None and low is not None and high is not None
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > orig / low, inv_freq / factor, inv_freq)
    smooth = (orig / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < orig / high) * ~(wavelen > orig / low)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Computes ``(cos, sin)`` tables ``[B, S, rot_dim]`` for given ``position_ids``.

    Args:
        params: RoPE parameters.
        head_dim: Per-head width.
        max_position_embeddings: Model context length.
    """

    def __init__(self, params: RopeParameters, head_dim: int, max_position_embeddings: int) -> None:
        super().__init__()
        self.params = params
        self.head_dim = head_dim
        self.max_position_embeddings = max_position_embeddings
        self.rotary_dim = int(head_dim * params.partial_rotary_factor)

    @torch.no_grad()
    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(cos, sin)`` of shape ``[B, S, rotary_dim]`` in ``dtype``."""
        seq_len = None
        if self.params.rope_type == "dynamic":
            # Like HF's dynamic_rope_update: the base grows with the largest position seen.
            seq_len = int(position_ids.max().item()) + 1
        inv_freq, scale = rope_inv_freq(
            self.params, self.head_dim, self.max_position_embeddings, seq_len, position_ids.device
        )
        freqs = position_ids[..., None].float() * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)

    def extra_repr(self) -> str:
        return f"type={self.params.rope_type}, theta={self.params.rope_theta}, rotary_dim={self.rotary_dim}"


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q``/``k`` of shape ``[B, S, heads, head_dim]`` (NeoX half-split layout).

    With partial rotary (``cos.shape[-1] < head_dim``) only the first ``rotary_dim`` dims of each
    head are rotated; the rest pass through.
    """
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    rot = cos.shape[-1]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        if rot == x.shape[-1]:
            return x * cos + _rotate_half(x) * sin
        x_rot, x_pass = x[..., :rot], x[..., rot:]
        return torch.cat((x_rot * cos + _rotate_half(x_rot) * sin, x_pass), dim=-1)

    return rotate(q), rotate(k)
