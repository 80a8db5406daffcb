"""Weighted mixtures of datasets: a fixed, seeded assignment of rows to sources."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from plait.loop.config.loading import ConfigError

__all__ = ["MixtureDataset", "mixture_counts"]


def mixture_counts(weights: Sequence[float], total: int) -> list[int]:
    """Rows per source out of ``total``, proportional to ``weights`` (largest remainders: each count is
    within one row of ``total * w / sum(w)``, and they add up to ``total``).

    Raises:
        ValueError: a weight that is not a finite positive number (naming its index).
    """
    for i, w in enumerate(weights):
        if not (math.isfinite(w) and w > 0):
            raise ValueError(f"weight {i} is {w!r}; weights must be finite and > 0")
    exact = [total * w / sum(weights) for w in weights]
    counts = [math.floor(x) for x in exact]
    by_remainder = sorted(range(len(weights)), key=lambda i: (counts[i] - exact[i], i))
    for i in by_remainder[: total - sum(counts)]:
        counts[i] += 1
    return counts


class MixtureDataset(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Rows of several map-style datasets, mixed in proportion to ``weights``.

    Row ``i`` is row ``index[i]`` of dataset ``source[i]``: a pure function of (the datasets' sizes, the
    weights, ``seed``), the same in every process, so the loader's global order, its sharding over
    data-parallel ranks and its resume state (the global batches consumed) work on a mixture as on one
    dataset. Source ``k`` gets :func:`mixture_counts` rows of ``num_samples`` (default: all the
    datasets' rows together), spread over the mixture by a seeded permutation; its rows are taken in a
    seeded order of its own, from the start again when it is drawn more often than it has rows (a
    small source repeats, a large one is subsampled).

    Args:
        datasets: the sources.
        weights: one finite positive weight per source (relative: they need not add up to 1).
        seed: the assignment's seed.
        num_samples: the mixture's size.

    Raises:
        ValueError: no datasets, an empty one, or weights that do not match them or are not positive.
    """

    def __init__(
        self,
        datasets: Sequence[Any],
        weights: Sequence[float],
        seed: int = 0,
        num_samples: int | None = None,
    ) -> None:
        if not datasets:
            raise ValueError("a mixture needs at least one dataset")
        if len(weights) != len(datasets):
            raise ValueError(f"{len(weights)} weights for {len(datasets)} datasets")
        sizes = [len(d) for d in datasets]
        for k, n in enumerate(sizes):
            if n == 0:
                raise ValueError(f"dataset {k} of the mixture is empty")
        total = sum(sizes) if num_samples is None else num_samples
        counts = mixture_counts([float(w) for w in weights], total)
        rng = np.random.Generator(np.random.PCG64(seed))
        self.source = rng.permutation(np.repeat(np.arange(len(datasets)), counts)).astype(np.int32)
        self.index = np.empty(total, dtype=np.int64)
        for k, (n, c) in enumerate(zip(sizes, counts, strict=True)):
            self.index[self.source == k] = rng.permutation(n)[np.arange(c) % n]
        self.datasets = list(datasets)
        self.weights = [float(w) for w in weights]
        self.counts = counts
        self.seed = seed

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, i: int) -> Any:
        return self.datasets[int(self.source[i])][int(self.index[i])]

    def state_dict(self) -> dict[str, Any]:
        """What the assignment is a function of: the sources' sizes, the weights and the seed."""
        return {"sizes": [len(d) for d in self.datasets], "weights": self.weights, "seed": self.seed}

    def check_state(self, state: Mapping[str, Any]) -> None:
        """Raise ``ConfigError`` naming what differs when ``state`` (a :meth:`state_dict`) is another mixture's:
        its sources' sizes (rows, in ``data.mixture`` order), weights or seed."""
        mine = self.state_dict()
        for key in ("sizes", "weights", "seed"):
            if key in state and state[key] != mine[key]:
                raise ConfigError(
                    f"data.mixture: the sources' {key} were {state[key]} when the checkpoint was saved, now "
                    f"{mine[key]} (give the run the data it had, or a new run directory)"
                )
