"""DeviceMeshParameters: defaults, aliases, validation messages naming the field."""

from __future__ import annotations

import pytest
from plait.dist_core import DeviceMeshParameters
from pydantic import ValidationError


def test_defaults_are_single_process() -> None:
    p = DeviceMeshParameters()
    assert p.world_size == 1 and p.is_single_process
    p.validate_world_size(1)


def test_world_size_is_product_without_expert() -> None:
    p = DeviceMeshParameters(pipeline=2, data_replicate=2, data_shard=3, context_shard=2, tensor=2, expert=4)
    assert p.world_size == 2 * 2 * 3 * 2 * 2
    assert p.data == 6 and p.context == 2 and p.data_context == 12


def test_long_and_short_aliases() -> None:
    a = DeviceMeshParameters(pipeline_parallel=2, data_parallel_shard=4, tensor_parallel=2, expert_parallel=2)
    b = DeviceMeshParameters(pp=2, dp_shard=4, tp=2, ep=2)
    c = DeviceMeshParameters(pipeline=2, data_shard=4, tensor=2, expert=2)
    assert a == b == c


def test_frozen() -> None:
    p = DeviceMeshParameters()
    with pytest.raises(ValidationError):
        p.tensor = 2  # type: ignore[misc]


@pytest.mark.parametrize(
    "field",
    ["pipeline", "data_replicate", "data_shard", "context_shard", "context_replicate", "tensor", "expert"],
)
@pytest.mark.parametrize("value", [0, -1])
def test_degree_below_one_names_the_field(field: str, value: int) -> None:
    with pytest.raises(ValidationError) as info:
        DeviceMeshParameters(**{field: value})
    assert info.value.errors()[0]["loc"] == (field,)
    assert field in str(info.value)


def test_non_integer_degree_is_rejected() -> None:
    with pytest.raises(ValidationError, match="tensor"):
        DeviceMeshParameters(tensor=1.5)
    with pytest.raises(ValidationError, match="tensor"):
        DeviceMeshParameters(tensor="2")


def test_unknown_field_is_rejected() -> None:
    with pytest.raises(ValidationError, match="sequence"):
        DeviceMeshParameters(sequence=2)


def test_expert_must_divide_data_times_context() -> None:
    with pytest.raises(ValidationError, match="expert=3 must divide"):
        DeviceMeshParameters(data_shard=2, context_shard=2, expert=3)
    # Tensor and pipeline ranks do not count: 4 does not divide dp*cp = 2.
    with pytest.raises(ValidationError, match="expert"):
        DeviceMeshParameters(data_shard=2, tensor=2, pipeline=2, expert=4)
    assert DeviceMeshParameters(data_replicate=2, context_replicate=2, expert=4).expert == 4


def test_validate_world_size_message() -> None:
    p = DeviceMeshParameters(tensor=2, data_shard=2)
    p.validate_world_size(4)
    with pytest.raises(ValueError, match=r"data_shard=2 .* tensor=2 = 4, but the world size is 8"):
        p.validate_world_size(8)
