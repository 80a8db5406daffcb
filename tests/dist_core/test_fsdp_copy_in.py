"""FSDP2's gradient copy-in (``plait.dist_core.fsdp_copy_in``) against ``torch._chunk_cat``, which FSDP2 runs
without it; the FSDP2 gradient parity tests (``test_parallelize.py``, the models' layout tests) run through it."""

from __future__ import annotations

import pytest
import torch
from plait.dist_core import fsdp_copy_in
from torch.distributed.fsdp._fully_shard import _fsdp_collectives


def _grads(shapes: list[tuple[int, ...]], dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=g).to(dtype) for s in shapes]


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize(
    "shapes",
    [
        [(8, 3), (4,), (16, 2, 5)],  # every first dim divisible: plait's concatenation
        [(6, 3), (4,), (5, 2)],  # 5 or 6 rows over 2 / 4 ranks: torch pads, FSDP2's own copy-in runs
    ],
)
def test_copy_in_equals_chunk_cat(
    world: int, shapes: list[tuple[int, ...]], monkeypatch: pytest.MonkeyPatch
) -> None:
    grads = _grads(shapes, torch.bfloat16)
    if all(s[0] % world == 0 for s in shapes):  # the per-gradient copies must run, not FSDP2's function

        def refuse(*_: object) -> None:
            raise AssertionError("FSDP2's copy-in ran for evenly divisible gradients")

        monkeypatch.setattr(fsdp_copy_in, "_ORIGINAL", refuse)
    expected = torch._chunk_cat(grads, dim=0, num_chunks=world)
    out = torch.full((expected.numel(),), float("nan"), dtype=torch.bfloat16)
    fsdp_copy_in.copy_in(grads, out, world)
    torch.testing.assert_close(out.view_as(expected), expected, rtol=0, atol=0)


def test_mixed_dtypes_take_fsdp2s_path() -> None:
    grads = [*_grads([(4, 2)]), *_grads([(4,)], torch.bfloat16)]
    out = torch.zeros(12, dtype=torch.float32)
    fsdp_copy_in.copy_in(grads, out, 2)
    reference = torch.zeros(12, dtype=torch.float32)
    fsdp_copy_in._ORIGINAL(grads, reference, 2)
    torch.testing.assert_close(out, reference, rtol=0, atol=0)


def test_install_replaces_the_function_fsdp2_calls() -> None:
    # The contract with the installed torch: FSDP2's reduce-scatter calls this module-level name.
    import inspect

    source = inspect.getsource(_fsdp_collectives.foreach_reduce)
    assert "foreach_reduce_scatter_copy_in(" in source, (
        "FSDP2's foreach_reduce no longer calls the copy-in by name"
    )
    fsdp_copy_in.install()
    assert _fsdp_collectives.foreach_reduce_scatter_copy_in is fsdp_copy_in.copy_in
