"""Rank layouts of the five mesh domains against a hand-written reference (no processes)."""

from __future__ import annotations

import itertools

import pytest
from plait.dist_core import DOMAIN_DIMS, DeviceMeshParameters, domain_coordinates, domain_groups
from plait.dist_core.domains import domain_shape

CONFIGS = [
    {},
    {"data_shard": 2, "expert": 2},
    {"pipeline": 2, "data_replicate": 2, "tensor": 2},
    {
        "data_replicate": 2,
        "data_shard": 2,
        "context_shard": 2,
        "context_replicate": 2,
        "tensor": 2,
        "expert": 4,
    },
    {"pipeline": 2, "data_shard": 3, "context_shard": 2, "tensor": 2, "expert": 3},
    {"pipeline": 3, "data_replicate": 2, "context_replicate": 2, "expert": 2},
]


def reference_coordinates(p: DeviceMeshParameters, rank: int) -> dict[str, dict[str, int]]:
    """Coordinates of ``rank`` in every domain, written out from the documented layout rules."""
    sizes = [p.pipeline, p.data_replicate, p.data_shard, p.context_shard, p.context_replicate, p.tensor]
    coords = []
    rest = rank
    for size in reversed(sizes):  # tp innermost
        rest, c = divmod(rest, size)
        coords.append(c)
    pp, dpr, dps, cps, cpr, tp = reversed(coords)
    dp = dpr * p.data_shard + dps
    cp = cps * p.context_replicate + cpr
    data_context_index = dp * p.context + cp
    return {
        "regular": {
            "pp": pp,
            "dp_replicate": dpr,
            "dp_shard": dps,
            "cp_shard": cps,
            "cp_replicate": cpr,
            "tp": tp,
        },
        "dense": {
            "pp": pp,
            "dp_replicate": dpr,
            "dp_cp_shard": dps * p.context_shard + cps,
            "cp_replicate": cpr,
            "tp": tp,
        },
        "batch": {"pp": pp, "dp": dp, "cp": cp, "tp": tp},
        "expert": {
            "pp": pp,
            "ep_replicate": (data_context_index // p.expert) * p.tensor + tp,
            "ep_shard": data_context_index % p.expert,
        },
        "flat": {"world": rank},
    }


@pytest.mark.parametrize("config", CONFIGS)
def test_coordinates_match_reference(config: dict[str, int]) -> None:
    p = DeviceMeshParameters(**config)
    seen: dict[str, set[tuple[int, ...]]] = {d: set() for d in DOMAIN_DIMS}
    for rank in range(p.world_size):
        ref = reference_coordinates(p, rank)
        for domain in DOMAIN_DIMS:
            got = domain_coordinates(p, domain, rank)
            assert got == ref[domain], (domain, rank)
            seen[domain].add(tuple(got.values()))
    for domain in DOMAIN_DIMS:  # every domain is a bijection between ranks and coordinates
        assert len(seen[domain]) == p.world_size
        shape = domain_shape(p, domain)
        assert seen[domain] == set(itertools.product(*(range(s) for s in shape)))


@pytest.mark.parametrize("config", CONFIGS)
def test_groups_vary_only_their_dimension(config: dict[str, int]) -> None:
    p = DeviceMeshParameters(**config)
    for domain, dims in DOMAIN_DIMS.items():
        for dim in dims:
            groups = domain_groups(p, domain, dim)
            assert sorted(r for g in groups for r in g) == list(range(p.world_size))
            for group in groups:
                coords = [domain_coordinates(p, domain, r) for r in group]
                assert [c[dim] for c in coords] == list(range(len(group)))
                others = {tuple(v for k, v in c.items() if k != dim) for c in coords}
                assert len(others) == 1


@pytest.mark.parametrize("config", CONFIGS)
def test_expert_groups_are_subgroups_of_data_context_groups(config: dict[str, int]) -> None:
    p = DeviceMeshParameters(**config)
    for group in domain_groups(p, "expert", "ep_shard"):
        batch = [domain_coordinates(p, "batch", r) for r in group]
        # same pipeline stage and tensor rank: experts are split over data/context ranks only
        assert len({(c["pp"], c["tp"]) for c in batch}) == 1
        assert len(group) == p.expert
    for group in domain_groups(p, "expert", "ep_replicate"):
        assert len({domain_coordinates(p, "batch", r)["pp"] for r in group}) == 1


def test_dense_shard_group_is_dp_shard_times_cp_shard() -> None:
    p = DeviceMeshParameters(data_replicate=2, data_shard=2, context_shard=2, tensor=2)
    for group in domain_groups(p, "dense", "dp_cp_shard"):
        regular = [domain_coordinates(p, "regular", r) for r in group]
        assert {(c["dp_shard"], c["cp_shard"]) for c in regular} == {
            (a, b) for a in range(2) for b in range(2)
        }
        assert len({(c["pp"], c["dp_replicate"], c["cp_replicate"], c["tp"]) for c in regular}) == 1


def test_unknown_domain_and_dim_errors() -> None:
    p = DeviceMeshParameters()
    with pytest.raises(ValueError, match="valid domains: regular, dense, expert, batch, flat"):
        domain_coordinates(p, "sparse", 0)
    with pytest.raises(ValueError, match="its dimensions: pp, dp, cp, tp"):
        domain_groups(p, "batch", "ep_shard")
    with pytest.raises(ValueError, match="rank 1 is outside"):
        domain_coordinates(p, "flat", 1)
