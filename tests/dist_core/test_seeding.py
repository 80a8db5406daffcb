"""Seeding rules: which mesh coordinates change a seed, checked exhaustively and on 8 CPU ranks."""

from __future__ import annotations

import itertools

import pytest
import torch
from plait.dist_core import (
    DeviceMeshParameters,
    DistributedContext,
    seed_for,
    seed_from_coordinates,
    set_seed,
)
from plait.dist_core.testing import run_distributed

# kind -> the batch-domain coordinates that must change the seed (all others must not)
RULES = {"model": {"pp"}, "data": {"dp"}, "compute": {"pp", "dp", "cp"}}
DIMS = ("pp", "dp", "cp", "tp")


@pytest.mark.parametrize("kind", sorted(RULES))
def test_seed_depends_on_exactly_the_documented_coordinates(kind: str) -> None:
    grid = [
        dict(zip(DIMS, c, strict=True)) for c in itertools.product(range(2), range(3), range(2), range(2))
    ]
    seeds = {tuple(c.values()): seed_from_coordinates(7, kind, c) for c in grid}  # type: ignore[arg-type]
    for a, b in itertools.combinations(grid, 2):
        differs = {d for d in DIMS if a[d] != b[d]}
        same_seed = seeds[tuple(a.values())] == seeds[tuple(b.values())]
        assert same_seed == (not differs & RULES[kind]), (kind, a, b)
    assert all(0 <= s < 2**63 for s in seeds.values())


def test_base_seed_and_kind_change_the_seed() -> None:
    c = {"pp": 0, "dp": 0, "cp": 0, "tp": 0}
    assert seed_from_coordinates(1, "data", c) != seed_from_coordinates(2, "data", c)
    assert len({seed_from_coordinates(1, k, c) for k in RULES}) == 3  # type: ignore[arg-type]
    assert seed_from_coordinates(1, "data", c) == seed_from_coordinates(1, "data", dict(c))  # deterministic


def test_bad_kind_and_missing_coordinate() -> None:
    with pytest.raises(ValueError, match="valid kinds: model, data, compute"):
        seed_from_coordinates(0, "dropout", {"pp": 0})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs coordinate 'dp'"):
        seed_from_coordinates(0, "data", {"pp": 0})


def _draws(config: dict[str, int], device: str = "cpu") -> dict[str, object]:
    ctx = DistributedContext.from_env(DeviceMeshParameters(**config), device=device)
    out: dict[str, object] = {"coords": ctx.coordinates("batch")}
    for kind in RULES:
        set_seed(1234, ctx, kind)  # type: ignore[arg-type]
        out[kind] = (seed_for(1234, ctx, kind), torch.rand(4, device=ctx.device))  # type: ignore[arg-type]
    ctx.shutdown()
    return out


def check_random_streams(config: dict[str, int], backend: str = "gloo", device: str = "cpu") -> None:
    world = DeviceMeshParameters(**config).world_size
    results = run_distributed(_draws, world, config, device, backend=backend)
    for kind, dims in RULES.items():
        for a, b in itertools.combinations(results, 2):
            must_match = all(a["coords"][d] == b["coords"][d] for d in dims)
            assert (a[kind][0] == b[kind][0]) == must_match
            assert torch.equal(a[kind][1], b[kind][1]) == must_match, (kind, a["coords"], b["coords"])


def test_random_streams_on_8_ranks() -> None:
    check_random_streams({"pipeline": 2, "data_shard": 2, "tensor": 2})
