"""The ``--check`` comparison of the benchmark scripts: parse a committed table, flag slower rows."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.regression import (
    device_mismatch,
    median_rows,
    parse_number,
    parse_table,
    regressions,
    report,
    row_id,
)

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"

TABLE = """# kernels

| id | kernel | shape | impl | ms | note |
|---|---|---|---|---:|---|
| `rms-norm-fwd/32768x4096/plait` | rms_norm fwd | 32768x4096 | plait | 0.184 | |
| `rms-norm-bwd/32768x4096/plait` | rms_norm bwd | 32768x4096 | plait | 0.311 | |
| `lce/n8192/cce` | linear-CE | N=8192 | cce | - | ImportError |

text after the table
"""


def test_row_id_is_stable_and_readable() -> None:
    assert row_id("rms_norm fwd", "32768x4096", "plait") == "rms-norm-fwd/32768x4096/plait"
    assert row_id("gmm bwd (weights only)", "E=128 M=65536", "plait auto") == (
        "gmm-bwd-weights-only/e128-m65536/plait-auto"
    )


def test_parse_table_reads_ids_and_numbers() -> None:
    rows = parse_table(TABLE, "ms")
    assert rows == {"rms-norm-fwd/32768x4096/plait": 0.184, "rms-norm-bwd/32768x4096/plait": 0.311}
    assert parse_number("139.2k") == 139200.0
    assert parse_number("**1.03x**") == 1.03
    assert parse_number("-") is None


def test_parse_table_reads_every_table_with_the_columns() -> None:
    later = """
| id | row | ms | vs plait |
|---|---|---:|---:|
| `gmm-fwd/e64/plait` | gmm fwd | 0.41 | 1.00x |
| - | torch (same call) | 0.52 | 0.79x |

| kernel | ms |
|---|---:|
| not an id table | 9.9 |
"""
    rows = parse_table(TABLE + later, "ms")
    assert rows == {
        "rms-norm-fwd/32768x4096/plait": 0.184,
        "rms-norm-bwd/32768x4096/plait": 0.311,
        "gmm-fwd/e64/plait": 0.41,
    }
    with pytest.raises(ValueError, match="'rms-norm-fwd/32768x4096/plait' appears twice"):
        parse_table(TABLE + later.replace("gmm-fwd/e64/plait", "rms-norm-fwd/32768x4096/plait"), "ms")


def test_parse_table_names_the_missing_column_and_duplicate_ids() -> None:
    with pytest.raises(ValueError, match="'tok/s'"):
        parse_table(TABLE, "tok/s")
    twice = TABLE.replace("rms-norm-bwd", "rms-norm-fwd")
    with pytest.raises(ValueError, match="appears twice"):
        parse_table(twice, "ms")


def test_a_time_more_than_five_percent_slower_is_flagged() -> None:
    committed = parse_table(TABLE, "ms")
    runs = [
        {"rms-norm-fwd/32768x4096/plait": 0.183, "rms-norm-bwd/32768x4096/plait": 0.40},
        {"rms-norm-fwd/32768x4096/plait": 0.300, "rms-norm-bwd/32768x4096/plait": 0.33},
        {"rms-norm-fwd/32768x4096/plait": 0.190, "rms-norm-bwd/32768x4096/plait": 0.35},
    ]
    measured = median_rows(runs)  # fwd 0.190 (+3.3%: one slow run does not count), bwd 0.35 (+12.5%)
    assert measured == {"rms-norm-fwd/32768x4096/plait": 0.190, "rms-norm-bwd/32768x4096/plait": 0.35}
    slower = regressions(committed, measured, higher_is_better=False)
    assert [r.row for r in slower] == ["rms-norm-bwd/32768x4096/plait"]
    assert slower[0].slowdown == pytest.approx(0.35 / 0.311 - 1)
    assert report(slower, 2, "kernels.md") == 1
    assert report([], 2, "kernels.md") == 0


def test_a_rate_more_than_five_percent_lower_is_flagged() -> None:
    committed = {"moe/plait-trainer-compiled": 139_200.0, "moe/hf-compiled": 135_700.0}
    measured = {"moe/plait-trainer-compiled": 131_000.0, "moe/hf-compiled": 130_000.0, "new/row": 1.0}
    slower = regressions(committed, measured, higher_is_better=True)
    # 139.2k / 131.0k = 6.3% slower; 135.7k / 130.0k = 4.4%: within the tolerance; new rows are not compared
    assert [r.row for r in slower] == ["moe/plait-trainer-compiled"]


def test_device_mismatch_warns_only_for_another_gpu() -> None:
    text = "# t\n\n**device:** NVIDIA H100 80GB HBM3 (one-GPU machine) | torch 2.11 | 2026-11-26\n\n" + TABLE
    assert device_mismatch(text, "NVIDIA H100 80GB HBM3") is None
    warning = device_mismatch(text, "NVIDIA H200")
    assert warning is not None
    assert "NVIDIA H100 80GB HBM3 (one-GPU machine)" in warning and "NVIDIA H200" in warning
    assert "torch" not in warning  # only the device field of the line
    assert device_mismatch(TABLE, "NVIDIA H200") is None  # a table without a device line


def test_committed_tables_name_their_device() -> None:
    for name in ("kernels.md", "training.md"):
        text = (BENCHMARKS / "results" / name).read_text()
        assert device_mismatch(text, "a GPU no table names") is not None, name
