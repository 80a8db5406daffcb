"""The load-balanced context-parallel layout: chunks i and 2n-1-i of 2n, and its inverse."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from plait.dist_core import (
    gather_sequence,
    load_balanced_indices,
    shard_batch,
    shard_sequence,
    unshard_sequence,
)
from plait.dist_core.testing import run_distributed


def test_indices_are_chunk_pairs() -> None:
    # T = 16, n = 4: chunks of 2; rank 1 holds chunks 1 and 6.
    assert load_balanced_indices(16, 4, 1).tolist() == [2, 3, 12, 13]
    assert load_balanced_indices(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert load_balanced_indices(8, 1, 0).tolist() == list(range(8))
    every = torch.cat([load_balanced_indices(24, 3, r) for r in range(3)])
    assert sorted(every.tolist()) == list(range(24))


@pytest.mark.parametrize("n", [1, 2, 4])
def test_shard_matches_indices_and_unshard_inverts(n: int) -> None:
    x = torch.arange(2 * 16 * 3).reshape(2, 16, 3)
    shards = [shard_sequence(x, n, r) for r in range(n)]
    for r, s in enumerate(shards):
        assert torch.equal(s, x[:, load_balanced_indices(16, n, r)])
    assert torch.equal(unshard_sequence(shards), x)
    # another sequence dim
    assert torch.equal(
        unshard_sequence(
            [shard_sequence(x.transpose(0, 1), n, r, dim=0).transpose(0, 1) for r in range(n)], dim=1
        ),
        x,
    )


def test_unshard_is_differentiable() -> None:
    x = torch.randn(1, 8, requires_grad=True)
    shards = [shard_sequence(x, 2, r) for r in range(2)]
    (unshard_sequence(shards) * torch.arange(8.0)).sum().backward()
    assert torch.equal(x.grad, torch.arange(8.0)[None])  # type: ignore[arg-type]


def test_shard_batch_and_errors() -> None:
    batch = {"input_ids": torch.arange(8)[None], "labels": torch.arange(8, 16)[None]}
    out = shard_batch(batch, 2, 1)
    assert out["input_ids"].tolist() == [[2, 3, 4, 5]]
    assert out["labels"].tolist() == [[10, 11, 12, 13]]
    with pytest.raises(
        ValueError, match="sequence length 6 must be divisible by 2 \\* context-parallel size = 4"
    ):
        shard_sequence(torch.zeros(1, 6), 2, 0)
    with pytest.raises(ValueError, match="different sequence lengths"):
        shard_batch({"input_ids": torch.zeros(1, 8), "labels": torch.zeros(1, 4)}, 2, 0)
    with pytest.raises(ValueError, match="batch\\['x'\\] has shape \\(8,\\), no dim 1"):
        shard_batch({"x": torch.zeros(8)}, 2, 0)
    with pytest.raises(ValueError, match="rank 2 outside \\[0, 2\\)"):
        load_balanced_indices(8, 2, 2)


def _gather_rank() -> torch.Tensor:
    full = torch.arange(3 * 24).reshape(3, 24)
    local = shard_sequence(full, dist.get_world_size(), dist.get_rank())
    return gather_sequence(local, None)


def test_gather_sequence_restores_full_order() -> None:
    want = torch.arange(3 * 24).reshape(3, 24)
    for res in run_distributed(_gather_rank, 3):
        assert torch.equal(res, want)
