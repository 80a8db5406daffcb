"""DistributedContext on 1, 2, 4 and 8 CPU ranks: domains, coordinates, groups, helpers."""

from __future__ import annotations

import logging
import os
import re
import tempfile
import time

import pytest
import torch
import torch.distributed as dist
from plait.dist_core import DOMAIN_DIMS, DeviceMeshParameters, DistributedContext
from plait.dist_core.testing import DistributedTestError, run_distributed

from tests.dist_core._dist_fns import context_facts
from tests.dist_core.test_domains import reference_coordinates


def _check_facts(config: dict[str, int], facts: list[dict[str, object]]) -> None:
    p = DeviceMeshParameters(**config)
    assert [f["rank"] for f in facts] == list(range(p.world_size))
    assert [f["main"] for f in facts] == [r == 0 for r in range(p.world_size)]
    for rank, f in enumerate(facts):
        ref = reference_coordinates(p, rank)
        for domain, dims in DOMAIN_DIMS.items():
            d = f[domain]
            assert d["coordinate"] == ref[domain] == d["ctx_coordinate"], (rank, domain)  # type: ignore[index]
            for dim in dims:
                # the group along `dim`: ranks whose coordinates equal ours except in `dim`
                expected = [
                    r
                    for r in range(p.world_size)
                    if all(
                        v == ref[domain][k]
                        for k, v in reference_coordinates(p, r)[domain].items()
                        if k != dim
                    )
                ]
                expected.sort(key=lambda r: reference_coordinates(p, r)[domain][dim])
                assert d["groups"][dim] == expected == d["ctx_groups"][dim], (rank, domain, dim)  # type: ignore[index]
        tp_peers = f["batch"]["groups"]["tp"]  # type: ignore[index]
        assert f["tp_sum"] == float(sum(tp_peers))
        b = ref["batch"]
        assert f["prefix"] == f"[pp{b['pp']} dp{b['dp']} cp{b['cp']} tp{b['tp']}]"
        assert f["still_initialised"] is True


@pytest.mark.parametrize(
    "config",
    [
        {"data_shard": 2, "expert": 2},
        {"pipeline": 2, "context_shard": 2, "expert": 2},
        {"data_replicate": 2, "tensor": 2},
    ],
    ids=["dp_shard2-ep2", "pp2-cp2-ep2", "dpr2-tp2"],
)
def test_domains_on_2_and_4_ranks(config: dict[str, int]) -> None:
    world = DeviceMeshParameters(**config).world_size
    _check_facts(config, run_distributed(context_facts, world, config))


def test_domains_on_8_ranks() -> None:
    config = {"pipeline": 2, "data_shard": 2, "tensor": 2, "expert": 2}
    _check_facts(config, run_distributed(context_facts, 8, config))


def test_world_size_one_inside_harness() -> None:
    _check_facts({}, run_distributed(context_facts, 1, {}))


def test_single_process_without_process_group() -> None:
    assert not dist.is_initialized()
    ctx = DistributedContext.from_env(DeviceMeshParameters(), device="cpu")
    assert (
        not ctx.is_distributed and ctx.world_size == 1 and ctx.is_main_process and ctx.is_local_main_process
    )
    ctx.barrier()
    with ctx.main_process_first():
        pass
    ctx.set_timeout(5.0)
    assert not dist.is_initialized()  # nothing so far needed a group
    mesh = ctx.mesh_for("regular")  # DeviceMesh needs a world-size-1 group: created on demand
    assert mesh.shape == (1, 1, 1, 1, 1, 1) and dist.is_initialized()
    assert ctx.mesh_for("flat").mesh.tolist() == [0]
    ctx.shutdown()
    assert not dist.is_initialized()
    ctx.shutdown()  # idempotent


@pytest.mark.gpu
def test_single_process_cuda_group_is_bound_to_the_device() -> None:
    """The world-size-1 NCCL group of a one-GPU run knows its device: a barrier on it (as the HF export
    and the checkpointer make) does not warn that it guesses the device."""
    import warnings

    ctx = DistributedContext.from_env(DeviceMeshParameters(), device="cuda")
    ctx.mesh_for("regular")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # torch's "barrier(): using the device under current context"
            dist.barrier()
    finally:
        ctx.shutdown()
    assert not dist.is_initialized()


def test_single_process_world_size_mismatch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match="tensor=2 = 2, but the world size is 1"):
        DistributedContext.from_env(DeviceMeshParameters(tensor=2), device="cpu")


def test_unknown_domain_lists_valid_ones() -> None:
    ctx = DistributedContext.from_env(DeviceMeshParameters(), device="cpu")
    with pytest.raises(ValueError, match="valid domains: regular, dense, expert, batch, flat"):
        ctx.mesh_for("moe")
    with pytest.raises(ValueError, match="device must be"):
        DistributedContext.from_env(DeviceMeshParameters(), device="meta")


def _mismatched_world() -> None:
    DistributedContext.from_env(DeviceMeshParameters(data_shard=4), device="cpu")


def test_world_size_mismatch_under_harness_names_degrees() -> None:
    with pytest.raises(DistributedTestError, match=r"data_shard=4 .* but the world size is 2"):
        run_distributed(_mismatched_world, 2)


def _helpers(path: str) -> dict[str, object]:
    ctx = DistributedContext.from_env(DeviceMeshParameters(data_shard=2), device="cpu")
    # main_process_first: rank 0 writes, the others read what it wrote
    with ctx.main_process_first():
        if ctx.is_main_process:
            time.sleep(0.3)
            with open(path, "w") as f:
                f.write("written by rank 0")
        with open(path) as f:
            seen = f.read()
    with ctx.local_main_process_first():
        pass
    ctx.set_timeout(30.0)
    ctx.barrier()
    records: list[str] = []

    class _Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logger = logging.getLogger("plait")
    handler = _Collect()
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    ctx.logger.info("hello")
    logger.removeHandler(handler)
    facts = {
        "seen": seen,
        "log": records,
        "node_rank": ctx.node_rank,
        "local_rank": ctx.local_rank,
        "local_world_size": ctx.local_world_size,
        "host_backend": dist.get_backend(ctx.host_group),
    }
    ctx.shutdown()
    return facts


def test_main_process_first_barrier_timeout_logger() -> None:
    with tempfile.TemporaryDirectory() as d:
        out = run_distributed(_helpers, 2, os.path.join(d, "f.txt"))
    assert [o["seen"] for o in out] == ["written by rank 0"] * 2
    assert out[0]["log"] == ["[pp0 dp0 cp0 tp0] hello"] and out[1]["log"] == ["[pp0 dp1 cp0 tp0] hello"]
    assert [o["local_rank"] for o in out] == [0, 1] and all(o["node_rank"] == 0 for o in out)
    assert all(o["local_world_size"] == 2 and o["host_backend"] == "gloo" for o in out)


def _short_timeout() -> None:
    ctx = DistributedContext.from_env(DeviceMeshParameters(data_shard=2), device="cpu")
    ctx.set_timeout(1.0)
    if ctx.rank == 0:
        t = torch.zeros(1)
        dist.all_reduce(t, group=ctx.mesh_for("flat").get_group())  # rank 1 joins too late
    else:
        time.sleep(1.5)  # longer than the 1 s timeout, shorter than the harness grace


def test_set_timeout_shortens_collectives() -> None:
    t0 = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_short_timeout, 2, timeout=60.0)
    assert info.value.failed_ranks == [0]
    assert re.search("timed out|timeout", str(info.value), re.IGNORECASE)
    assert time.monotonic() - t0 < 30.0
