"""The load-balanced sequence layout of context parallelism.

A sequence of length ``T`` is cut into ``2n`` equal chunks for ``n`` context ranks; rank ``i`` holds
chunks ``i`` and ``2n-1-i`` (in that order). Under a causal mask an early chunk attends to little
and a late one to much, so pairing them gives every rank the same attention work.

These functions only move data; they know nothing about models. The loop shards every
``[B, T, ...]`` tensor of a microbatch with :func:`shard_batch` (or :func:`shard_sequence`), a model
restores the full order with :func:`unshard_sequence` after an all-gather (differentiable when the
all-gather is), and :func:`gather_sequence` gathers and reorders in one call (no gradient).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

__all__ = ["gather_sequence", "load_balanced_indices", "shard_batch", "shard_sequence", "unshard_sequence"]


def _chunk_len(seq_len: int, cp_size: int, what: str) -> int:
    if cp_size < 1:
        raise ValueError(f"context-parallel size must be >= 1, got {cp_size}")
    if seq_len % (2 * cp_size):
        raise ValueError(
            f"{what}: sequence length {seq_len} must be divisible by 2 * context-parallel size = "
            f"{2 * cp_size} (the load-balanced layout cuts it into 2 chunks per context rank)"
        )
    return seq_len // (2 * cp_size)


def _check_rank(cp_rank: int, cp_size: int) -> None:
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"context-parallel rank {cp_rank} outside [0, {cp_size})")


def load_balanced_indices(
    seq_len: int, cp_size: int, cp_rank: int, *, device: torch.device | str | None = None
) -> torch.Tensor:
    """Global sequence positions held by ``cp_rank``: chunks ``cp_rank`` and ``2n-1-cp_rank`` of ``2n``.

    Returns:
        int64 ``[seq_len // cp_size]``, ascending within each chunk.

    Raises:
        ValueError: ``seq_len`` is not divisible by ``2 * cp_size``, or ``cp_rank`` is out of range.
    """
    c = _chunk_len(seq_len, cp_size, "load_balanced_indices")
    _check_rank(cp_rank, cp_size)
    first = torch.arange(cp_rank * c, (cp_rank + 1) * c, device=device)
    last = torch.arange((2 * cp_size - 1 - cp_rank) * c, (2 * cp_size - cp_rank) * c, device=device)
    return torch.cat([first, last])


def shard_sequence(x: torch.Tensor, cp_size: int, cp_rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's part of ``x`` along ``dim``: chunks ``cp_rank`` and ``2n-1-cp_rank`` of ``2n``.

    Raises:
        ValueError: the length along ``dim`` is not divisible by ``2 * cp_size``, or a bad rank.
    """
    if cp_size == 1:
        return x
    c = _chunk_len(x.shape[dim], cp_size, "shard_sequence")
    _check_rank(cp_rank, cp_size)
    first = x.narrow(dim, cp_rank * c, c)
    last = x.narrow(dim, (2 * cp_size - 1 - cp_rank) * c, c)
    return torch.cat([first, last], dim=dim)


def unshard_sequence(shards: Sequence[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The full sequence from every rank's shard (``shards[i]`` from context rank ``i``).

    Built from ``narrow`` and ``cat``, so it is differentiable.
    """
    n = len(shards)
    if n == 0:
        raise ValueError("unshard_sequence needs at least one shard")
    if n == 1:
        return shards[0]
    length = shards[0].shape[dim]
    if length % 2 or any(s.shape[dim] != length for s in shards):
        raise ValueError(
            f"unshard_sequence: shards must have one even length along dim {dim}, got "
            f"{[s.shape[dim] for s in shards]}"
        )
    c = length // 2
    firsts = [s.narrow(dim, 0, c) for s in shards]
    lasts = [s.narrow(dim, c, c) for s in reversed(shards)]
    return torch.cat(firsts + lasts, dim=dim)


def gather_sequence(x: torch.Tensor, group: dist.ProcessGroup | None, dim: int = 1) -> torch.Tensor:
    """All-gather every context rank's shard of ``x`` and restore the full order (no gradient).

    Collective over ``group``: every rank must call it with equally shaped shards.
    """
    n = dist.get_world_size(group)
    if n == 1:
        return x
    x = x.contiguous()
    out = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(out, x, group=group)
    return unshard_sequence(out, dim)


def shard_batch(
    batch: Mapping[str, torch.Tensor], cp_size: int, cp_rank: int, dim: int = 1
) -> dict[str, torch.Tensor]:
    """Shard every tensor of a microbatch along its sequence dimension ``dim``.

    Every tensor must have the same length along ``dim`` (``input_ids``, ``labels``,
    ``position_ids``, ``document_ids``, ...). A batch without ``position_ids`` keeps none: the
    model then gives each token its global position from the layout.

    Raises:
        ValueError: a tensor has too few dims or a different sequence length (the key is named), or
            the length is not divisible by ``2 * cp_size``.
    """
    lengths = {}
    for key, value in batch.items():
        if value.dim() <= dim:
            raise ValueError(f"shard_batch: batch[{key!r}] has shape {tuple(value.shape)}, no dim {dim}")
        lengths[key] = value.shape[dim]
    if len(set(lengths.values())) > 1:
        raise ValueError(f"shard_batch: tensors have different sequence lengths along dim {dim}: {lengths}")
    return {key: shard_sequence(value, cp_size, cp_rank, dim) for key, value in batch.items()}
