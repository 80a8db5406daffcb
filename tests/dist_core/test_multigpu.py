"""The distributed tests again on NCCL with one GPU per rank (2 GPUs): ``pytest -m multigpu tests/dist_core``."""

from __future__ import annotations

import pytest
from plait.dist_core.testing import run_distributed

from tests.dist_core._dist_fns import context_facts
from tests.dist_core.test_collectives import check_collectives
from tests.dist_core.test_context import _check_facts
from tests.dist_core.test_grad_norm import check_mixed_norms
from tests.dist_core.test_parallelize import check_parallel_step
from tests.dist_core.test_seeding import check_random_streams

pytestmark = pytest.mark.multigpu

NCCL = {"backend": "nccl", "device": "cuda"}


@pytest.mark.parametrize("config", [{"data_shard": 2, "expert": 2}, {"tensor": 2}, {"pipeline": 2}])
def test_domains_nccl(config: dict[str, int]) -> None:
    _check_facts(config, run_distributed(context_facts, 2, config, "cuda", backend="nccl"))


def test_collectives_nccl() -> None:
    check_collectives({"data_shard": 2}, **NCCL)


def test_seeding_nccl() -> None:
    check_random_streams({"data_shard": 2}, **NCCL)


def test_grad_norm_nccl() -> None:
    check_mixed_norms({"data_shard": 2, "expert": 2}, **NCCL)
    check_mixed_norms({"pipeline": 2}, **NCCL)


@pytest.mark.parametrize(
    ("mode", "config", "reduce", "micro"),
    [
        ("replicate", {"data_replicate": 2}, "mean", 2),
        ("fsdp", {"data_shard": 2}, "mean", 1),
        ("fsdp", {"data_shard": 2}, "sum", 2),
        ("hsdp", {"data_replicate": 2}, "sum", 1),
    ],
)
def test_parallelize_nccl(mode: str, config: dict[str, int], reduce: str, micro: int) -> None:
    check_parallel_step(mode, config, reduce, micro, **NCCL)
