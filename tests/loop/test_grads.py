"""The gradient section of the config takes effect: the loop's data-parallel sum of plain gradients
runs in ``gradients.reduce_dtype`` and in buckets of ``gradients.bucket_size_mb``."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from plait.dist_core.testing import run_distributed
from plait.loop.config.sections import GradientConfig
from plait.loop.grads import all_reduce_plain_grads, prepare_fsdp_for_sum
from torch import nn

# 1 + 2**-10 is exact in float32 and rounds to 1.0 in bfloat16: the reduce dtype shows in the sum.
_VALUE = 1.0 + 2.0**-10
_NUMEL = 1 << 18  # 1 MiB of float32 per parameter


def _reduce(fields: dict[str, object]) -> tuple[list[float], int]:
    params = [nn.Parameter(torch.zeros(_NUMEL)) for _ in range(3)]
    for i, p in enumerate(params):
        p.grad = torch.full((_NUMEL,), _VALUE * (i + 1) * (dist.get_rank() + 1))
    calls = 0
    original = dist.all_reduce

    def counting(*args: object, **kwargs: object) -> object:
        nonlocal calls
        calls += 1
        return original(*args, **kwargs)  # type: ignore[arg-type]

    dist.all_reduce = counting  # type: ignore[assignment]
    try:
        all_reduce_plain_grads(params, None, GradientConfig(**fields))  # type: ignore[arg-type]
    finally:
        dist.all_reduce = original
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in params)
    return [float(p.grad[0]) for p in params], calls  # type: ignore[index]


def _expected(dtype: torch.dtype) -> list[float]:
    """Sum over ranks 1 and 2 of each parameter's gradient, each term rounded to ``dtype`` (float64 reference)."""
    out = []
    for i in range(3):
        terms = [torch.tensor(_VALUE * (i + 1) * r, dtype=torch.float64).to(dtype) for r in (1, 2)]
        out.append(float(sum(t.to(torch.float64) for t in terms).to(dtype)))
    return out


@pytest.mark.parametrize(
    ("fields", "dtype", "calls"),
    [
        ({}, torch.float32, 1),  # defaults: the gradients' dtype, one 25 MiB bucket for 3 MiB
        ({"reduce_dtype": "bfloat16"}, torch.bfloat16, 1),
        ({"reduce_dtype": "float32", "bucket_size_mb": 1.0}, torch.float32, 3),
        ({"bucket_size_mb": 2.0}, torch.float32, 2),
    ],
    ids=["default", "bf16", "fp32-1MiB", "2MiB"],
)
def test_gradient_section_takes_effect(fields: dict[str, object], dtype: torch.dtype, calls: int) -> None:
    results = run_distributed(_reduce, 2, fields)
    for values, n in results:
        assert n == calls
        assert values == _expected(dtype)
    if dtype == torch.bfloat16:  # and the bf16 sum really differs from the exact one
        assert results[0][0] != _expected(torch.float32)


def _prepare(reduce: str) -> str:
    from plait.dist_core import replicate
    from torch.distributed.device_mesh import init_device_mesh

    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    replicate(model[1], init_device_mesh("cpu", (1,)), reduce=reduce)  # type: ignore[arg-type]
    try:
        found = prepare_fsdp_for_sum([model])
    except ValueError as e:
        return str(e)
    return f"found {[type(m).__name__ for m in found]}"


def test_replicated_modules_are_found_and_must_sum() -> None:
    """``replicate``-d submodules are summed by the loop itself; a mean reduction is refused by name."""
    assert run_distributed(_prepare, 1, "sum") == ["found ['Linear']"]
    (msg,) = run_distributed(_prepare, 1, "mean")
    assert "replicated with reduce='mean'" in msg


def _prepare_rows() -> tuple[float | None, list[str]]:
    from plait.models.common.heads import TokenEmbedding
    from torch.distributed.device_mesh import init_device_mesh

    embed = TokenEmbedding(8, 2)
    embed.shard_rows(init_device_mesh("cpu", (1,)))
    found = prepare_fsdp_for_sum([nn.Sequential(embed)])
    return embed.gradient_divide_factor, [type(m).__name__ for m in found]


def test_a_row_sharded_embedding_sums_and_is_always_synced() -> None:
    """``parallel.shard_embedding_rows``'s table reduces its own gradient in the backward: the loop makes it a
    sum like FSDP2's, and it is no module whose gradient sync the loop switches off."""
    assert run_distributed(_prepare_rows, 1) == [(1.0, [])]
