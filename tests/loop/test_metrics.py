"""Metrics: reductions, composition, state, and synchronisation over a process group."""

from __future__ import annotations

import math

import pytest
import torch
from plait.dist_core.testing import run_distributed
from plait.loop import Derived, Max, Mean, MetricCollection, Min, Sum


def test_local_reductions_and_state():
    mc = MetricCollection({"loss": Mean(), "n": Sum(), "lo": Min(), "hi": Max()})
    mc.add("ppl", Derived(math.exp, "loss"))
    for v, w in [(2.0, 1.0), (4.0, 3.0)]:
        mc.update("loss", v, w)
        mc.update("n", torch.tensor(w))
        mc.update("lo", v)
        mc.update("hi", v)
    out = mc.compute(sync=False)
    assert out["loss"] == pytest.approx((2 + 12) / 4)
    assert out["ppl"] == pytest.approx(math.exp(3.5))
    assert (out["n"], out["lo"], out["hi"]) == (4.0, 2.0, 4.0)
    restored = MetricCollection({"loss": Mean(), "n": Sum(), "lo": Min(), "hi": Max()})
    restored.load_state_dict(mc.state_dict())
    assert restored.compute(sync=False) == {k: v for k, v in out.items() if k != "ppl"}
    mc.reset()
    assert math.isnan(mc.compute(sync=False)["loss"])


def _sync(values: list[float]) -> dict[str, float]:
    rank = torch.distributed.get_rank()
    mc = MetricCollection({"mean": Mean(), "sum": Sum(), "min": Min(), "max": Max()})
    for v in values[rank]:
        mc.update("mean", v, weight=rank + 1)
        mc.update("sum", v)
        mc.update("min", v)
        mc.update("max", v)
    if rank == 1:
        mc.update("only_on_rank1", 5.0)  # names are unioned across ranks
    return mc.compute()


def test_sync_over_group():
    values = [[1.0, 2.0], [10.0, -3.0, 4.0]]
    results = run_distributed(_sync, 2, values)
    assert results[0] == results[1]
    r = results[0]
    assert r["mean"] == pytest.approx((1 * 3 + 2 * 11) / (1 * 2 + 2 * 3))
    assert r["sum"] == pytest.approx(14.0)
    assert (r["min"], r["max"], r["only_on_rank1"]) == (-3.0, 10.0, 5.0)
