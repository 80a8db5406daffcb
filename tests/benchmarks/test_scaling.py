"""``scaling.median_of``: one row's runs in new processes as one table row."""

from __future__ import annotations

import pytest

from benchmarks.training.scaling import median_of


def _run(tps: float, peak: float, load: float) -> dict[str, object]:
    return {"row": "moe.plait_trainer_ep2", "tok_s_per_gpu": tps, "spread": 0.01, "peak_gib": peak,
            "expert_load_ep2": load, "windows": 3}  # fmt: skip


def test_the_median_run_and_the_spread_over_the_runs() -> None:
    got = median_of([_run(150.0, 7.0, 1.2), _run(120.0, 7.5, 1.3), _run(160.0, 6.9, 1.4)])
    assert got["tok_s_per_gpu"] == 150.0
    assert got["spread"] == pytest.approx(40.0 / 150.0)
    assert got["peak_gib"] == 7.5
    assert got["expert_load_ep2"] == pytest.approx(1.3)
    assert got["windows"] == 3 and got["runs"] == 3
    assert median_of([_run(100.0, 7.0, 1.0), _run(110.0, 7.0, 1.0)])["tok_s_per_gpu"] == 110.0  # the upper


def test_a_row_skipped_once_is_skipped_and_runs_of_other_rows_are_refused() -> None:
    skipped = {"row": "moe.plait_trainer_ep2", "skipped": "needs 2 GPUs"}
    assert median_of([_run(150.0, 7.0, 1.2), skipped]) == skipped
    with pytest.raises(ValueError, match="different rows"):
        median_of([_run(150.0, 7.0, 1.2), {**_run(150.0, 7.0, 1.2), "row": "moe.plait_trainer_fsdp2"}])
