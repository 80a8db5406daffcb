"""``parse_dtype`` / ``dtype_name``: the one parser of dtype names."""

from __future__ import annotations

import pytest
import torch
from plait.dist_core import dtype_name, parse_dtype


def test_config_and_wire_spellings() -> None:
    assert parse_dtype("bfloat16") is torch.bfloat16
    assert parse_dtype("torch.float32") is torch.float32  # str(dtype), as pipeline metadata sends it
    assert parse_dtype("int64") is torch.int64
    assert parse_dtype("bool") is torch.bool


@pytest.mark.parametrize(
    "dtype", [torch.float16, torch.bfloat16, torch.float64, torch.uint8, torch.complex64]
)
def test_round_trip(dtype: torch.dtype) -> None:
    assert dtype_name(dtype) == str(dtype).split(".")[-1]
    assert parse_dtype(dtype_name(dtype)) is dtype
    assert parse_dtype(str(dtype)) is dtype


@pytest.mark.parametrize("name", ["bf16", "float", "half", "torch.bf16", "", "Float32"])
def test_aliases_and_unknown_names_are_refused_by_name(name: str) -> None:
    with pytest.raises(ValueError, match=f"unknown dtype {name!r}"):
        parse_dtype(name)
