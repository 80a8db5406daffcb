"""Expert layout conversions (input-major, gate/up interleaved <-> plait's [E, 2I, H] gate rows first)
against hand-written indexing, their inverses, and the model-state mapper chain that does the same."""

from __future__ import annotations

import pytest
import torch
from plait.model_state import Deinterleave, Transpose
from plait.moe import (
    deinterleave_halves,
    down_from_input_major,
    down_to_input_major,
    gate_up_bias_from_interleaved,
    gate_up_bias_to_interleaved,
    gate_up_from_input_major_interleaved,
    gate_up_to_input_major_interleaved,
    interleave_halves,
    interleaved_order,
)

E, H, FFN = 3, 5, 4


def test_gate_up_weight_and_bias() -> None:
    w = torch.randn(E, H, 2 * FFN)  # HF: x @ w[e] -> [.., 2I], gate = [..., ::2], up = [..., 1::2]
    ours = gate_up_from_input_major_interleaved(w)
    assert ours.shape == (E, 2 * FFN, H) and ours.is_contiguous()
    x = torch.randn(7, H)
    for e in range(E):
        hf_out = x @ w[e]
        torch.testing.assert_close((x @ ours[e].T)[:, :FFN], hf_out[:, 0::2])  # gate rows first
        torch.testing.assert_close((x @ ours[e].T)[:, FFN:], hf_out[:, 1::2])
    assert torch.equal(gate_up_to_input_major_interleaved(ours), w)
    mapped = (Transpose("w", 1, 2) >> Deinterleave("w", dim=1)).map_state({"w": w})["w"]
    assert torch.equal(mapped, ours)

    b = torch.randn(E, 2 * FFN)
    ours_b = gate_up_bias_from_interleaved(b)
    assert torch.equal(ours_b, torch.cat([b[:, 0::2], b[:, 1::2]], dim=1))
    assert torch.equal(gate_up_bias_to_interleaved(ours_b), b)


def test_down_and_order() -> None:
    w = torch.randn(E, FFN, H)
    ours = down_from_input_major(w)
    assert torch.equal(ours, w.transpose(1, 2)) and ours.is_contiguous()
    assert torch.equal(down_to_input_major(ours), w)
    halves = torch.randn(2 * FFN, 3)
    assert torch.equal(halves[interleaved_order(FFN)], interleave_halves(halves, dim=0))
    assert torch.equal(deinterleave_halves(interleave_halves(halves, dim=0), dim=0), halves)


def test_bad_shapes_are_named() -> None:
    with pytest.raises(ValueError, match=r"must be even"):
        deinterleave_halves(torch.zeros(2, 5))
    with pytest.raises(ValueError, match=r"expected \[E, H, 2I\]"):
        gate_up_from_input_major_interleaved(torch.zeros(4, 6))
