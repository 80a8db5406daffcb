"""The global batch plan: which sample indices make up global batch ``k``, for any ``k``.

The plan is a pure function of (number of samples, global batch size, seed, lengths), so the only
state a resumable loader needs is one global counter — the number of global batches consumed. That
counter means the same thing for every data-parallel size, which is what makes the loader state
redistributable when the dp size changes on resume.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["GlobalBatchPlan"]


class GlobalBatchPlan:
    """Deterministic order of global batches over epochs.

    Each epoch is a permutation of the samples (seeded by ``seed + epoch``, or identity when
    ``shuffle=False``) cut into global batches; a trailing partial batch is dropped. With ``lengths``
    and ``bucket_buffer_batches = n > 1``, each window of ``n`` global batches is sorted by sample
    length before being cut (so a batch holds samples of similar length and padding is small), and the
    window's batches are then put back in a seeded random order.

    Args:
        num_samples: dataset size.
        global_batch_size: samples per optimizer step over all dp ranks.
        shuffle: permute each epoch.
        seed: base seed of the permutations.
        lengths: per-sample lengths for length bucketing.
        bucket_buffer_batches: window size, in global batches, of the length sort (0/1: off).
    """

    def __init__(
        self,
        num_samples: int,
        global_batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        lengths: Sequence[int] | None = None,
        bucket_buffer_batches: int = 0,
    ) -> None:
        if global_batch_size < 1:
            raise ValueError(f"global_batch_size must be >= 1, got {global_batch_size}")
        if num_samples < global_batch_size:
            raise ValueError(
                f"the dataset has {num_samples} samples, fewer than one global batch ({global_batch_size})"
            )
        if lengths is not None and len(lengths) != num_samples:
            raise ValueError(f"lengths has {len(lengths)} entries for {num_samples} samples")
        self.num_samples = num_samples
        self.global_batch_size = global_batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.lengths = torch.as_tensor(list(lengths), dtype=torch.int64) if lengths is not None else None
        self.bucket_buffer_batches = bucket_buffer_batches
        self.batches_per_epoch = num_samples // global_batch_size
        self._cache: tuple[int, list[list[int]]] | None = None

    def _epoch(self, epoch: int) -> list[list[int]]:
        if self._cache is not None and self._cache[0] == epoch:
            return self._cache[1]
        g = torch.Generator().manual_seed(self.seed + epoch)
        order = (
            torch.randperm(self.num_samples, generator=g) if self.shuffle else torch.arange(self.num_samples)
        )
        order = order[: self.batches_per_epoch * self.global_batch_size]
        gb = self.global_batch_size
        if self.lengths is not None and self.bucket_buffer_batches > 1:
            window = gb * self.bucket_buffer_batches
            batches: list[list[int]] = []
            for start in range(0, len(order), window):
                chunk = order[start : start + window]
                # Stable sort: ties keep the permutation order, so the plan stays deterministic.
                chunk = chunk[torch.sort(self.lengths[chunk], stable=True).indices]
                cut = [chunk[i : i + gb].tolist() for i in range(0, len(chunk), gb)]
                perm = torch.randperm(len(cut), generator=g).tolist() if self.shuffle else range(len(cut))
                batches.extend(cut[i] for i in perm)
        else:
            batches = [order[i : i + gb].tolist() for i in range(0, len(order), gb)]
        self._cache = (epoch, batches)
        return batches

    def global_batch(self, index: int) -> list[int]:
        """Sample indices of global batch ``index`` (counting across epochs from 0)."""
        epoch, i = divmod(index, self.batches_per_epoch)
        return self._epoch(epoch)[i]

    def rank_slice(self, index: int, dp_rank: int, dp_size: int) -> list[int]:
        """The contiguous share of global batch ``index`` that data-parallel rank ``dp_rank`` reads."""
        if self.global_batch_size % dp_size:
            raise ValueError(
                f"global_batch_size={self.global_batch_size} is not divisible by dp size {dp_size}"
            )
        per = self.global_batch_size // dp_size
        return self.global_batch(index)[dp_rank * per : (dp_rank + 1) * per]
