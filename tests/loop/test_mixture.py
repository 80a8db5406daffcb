"""Weighted mixtures: realised proportions, the same sequence on any number of ranks and across a
resume, and refusal of a resume onto another mixture."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from plait.loop.data import DistributedDataLoader, MixtureDataset, PackedTokens, mixture_counts

SEQ = 4


def _sources(sizes: list[int]) -> list[PackedTokens]:
    """Source ``k``'s row ``j`` holds the tokens ``10000 k + j`` (so every row names its origin)."""
    return [
        PackedTokens(np.repeat(10000 * k + np.arange(n + 1), SEQ)[: n * SEQ + 1], SEQ)
        for k, n in enumerate(sizes)
    ]


def _origin(batch: dict[str, torch.Tensor]) -> list[tuple[int, int]]:
    return [(int(t) // 10000, int(t) % 10000) for t in batch["input_ids"][:, 0]]


def test_counts_are_the_nearest_integers_to_the_weights():
    for weights, total in (([0.5, 0.3, 0.2], 1000), ([1, 1, 1], 100), ([7, 2], 13), ([1e-3, 1], 50)):
        counts = mixture_counts(weights, total)
        assert sum(counts) == total
        for c, w in zip(counts, weights, strict=True):
            assert abs(c - total * w / sum(weights)) < 1
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"weight 1 is"):
            mixture_counts([1.0, bad], 10)


def test_realised_proportions_match_the_weights():
    weights = [0.6, 0.3, 0.1]
    mix = MixtureDataset(_sources([50, 1500, 20]), weights, seed=3, num_samples=2000)
    loader = DistributedDataLoader(mix, global_batch_size=40, seed=1)
    seen = [k for _ in range(50) for k, _ in _origin(next(loader))]  # one epoch of the mixture
    assert [seen.count(k) for k in range(3)] == [1200, 600, 200]
    first = seen[:400]  # shuffled: any stretch of the epoch has about the same proportions
    for k, w in enumerate(weights):
        assert abs(first.count(k) / 400 - w) < 0.06
    # source 0 (50 rows) is repeated 24 times, each row equally often; source 1 is subsampled, no repeats
    rows = [o for i in range(len(mix)) for o in _origin({"input_ids": mix[i]["input_ids"][None]})]
    rows0 = [j for k, j in rows if k == 0]
    assert sorted(set(rows0)) == list(range(50)) and all(rows0.count(j) == 24 for j in range(50))
    rows1 = [j for k, j in rows if k == 1]
    assert len(set(rows1)) == len(rows1) == 600


@pytest.mark.parametrize("first_dp,second_dp", [(1, 4), (2, 1), (4, 2)])
def test_resumed_and_resharded_loader_continues_the_uninterrupted_sequence(first_dp, second_dp):
    def mixture() -> MixtureDataset:  # rebuilt on resume, as a restarted job does
        return MixtureDataset(_sources([30, 70, 11]), [2.0, 1.0, 1.0], seed=7)

    def loaders(dp: int) -> list[DistributedDataLoader]:
        data = mixture()
        return [
            DistributedDataLoader(data, global_batch_size=8, dp_rank=r, dp_size=dp, seed=5) for r in range(dp)
        ]

    def step(ls: list[DistributedDataLoader]) -> list[tuple[int, int]]:
        return [o for loader in ls for o in _origin(next(loader))]

    reference = loaders(1)
    want = [step(reference) for _ in range(30)]  # past the first epoch (111 rows / 8 = 13 steps)
    before = loaders(first_dp)
    got = [step(before) for _ in range(11)]
    after = loaders(second_dp)
    for loader in after:
        loader.load_state_dict(before[0].state_dict())
    got += [step(after) for _ in range(19)]
    assert got == want


def test_resume_onto_another_mixture_is_refused():
    a = DistributedDataLoader(MixtureDataset(_sources([30, 70]), [1.0, 1.0]), global_batch_size=4)
    next(a)
    for weights, sizes, what in (([1.0, 2.0], [30, 70], "weights"), ([1.0, 1.0], [31, 69], "sizes")):
        b = DistributedDataLoader(MixtureDataset(_sources(sizes), weights), global_batch_size=4)
        with pytest.raises(ValueError, match=f"data.mixture: the sources' {what} were"):
            b.load_state_dict(a.state_dict())
