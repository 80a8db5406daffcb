"""Regression guard for the benchmark tables: a run against the committed ``results/<name>.md``.

The kernel and training tables carry a stable ``id`` column (``row_id`` makes it from the row's
labels). ``--check`` in ``kernels/run_all.py`` and ``training/throughput.py`` runs each row three
times, takes the median and calls ``regressions`` with the committed table: a row more than
``tolerance`` slower than its committed figure is named, and the script exits non-zero.

    from benchmarks.regression import parse_table, regressions
    committed = parse_table(Path("benchmarks/results/kernels.md").read_text(), "ms")
    slower = regressions(committed, {"rms-norm-fwd/32768x4096/plait": 0.195}, higher_is_better=False)
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

TOLERANCE = 0.05
_UNIT = {"": 1.0, "k": 1e3, "M": 1e6}


def row_id(*labels: str) -> str:
    """A stable row id from a row's labels: lower case, words joined by ``-``, labels by ``/``.

    ``row_id("rms_norm fwd", "32768x4096", "plait")`` is ``"rms-norm-fwd/32768x4096/plait"``.
    """
    parts = [re.sub(r"[^a-z0-9.]+", "-", label.lower().replace("=", "")).strip("-") for label in labels]
    return "/".join(parts)


def parse_number(cell: str) -> float | None:
    """The first number of a table cell (``"139.2k"`` -> 139200.0, ``"**0.184**"`` -> 0.184), or None."""
    m = re.search(r"([-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)([kM]?)", cell.replace(",", ""))
    if m is None:
        return None
    return float(m[1]) * _UNIT[m[2]]


def parse_table(text: str, column: str, id_column: str = "id") -> dict[str, float]:
    """The ``column`` figure of every row that has an id, in every markdown table of ``text`` with both
    ``id_column`` and ``column`` (a page may hold more than one, e.g. a later call's rows).

    Rows whose figure is not a number (a failed or skipped row) or whose id is ``-`` are left out.

    Raises:
        ValueError: no table in ``text`` has both columns, or an id appears twice.
    """
    lines = text.splitlines()
    out: dict[str, float] = {}
    found = False
    for i, line in enumerate(lines):
        header = _cells(line)
        if id_column not in header or column not in header:
            continue
        found = True
        key, col = header.index(id_column), header.index(column)
        for row in lines[i + 2 :]:
            if not row.lstrip().startswith("|"):
                break
            cells = _cells(row)
            if len(cells) <= max(key, col):
                continue
            rid = cells[key].strip("`")
            if rid in ("", "-"):  # a row kept for reading, not for the check
                continue
            if rid in out:
                raise ValueError(f"row id {rid!r} appears twice in the tables")
            value = parse_number(cells[col])
            if value is not None:
                out[rid] = value
    if not found:
        raise ValueError(f"no markdown table with columns {id_column!r} and {column!r}")
    return out


def _cells(line: str) -> list[str]:
    s = line.strip()
    if not s.startswith("|"):
        return []
    return [c.strip() for c in s.strip("|").split("|")]


def median_rows(runs: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """Per row id, the median of its figures over ``runs`` (ids missing from a run use the others)."""
    values: dict[str, list[float]] = {}
    for run in runs:
        for rid, v in run.items():
            values.setdefault(rid, []).append(v)
    return {rid: statistics.median(vs) for rid, vs in values.items()}


@dataclass(frozen=True)
class Regression:
    """A row measured slower than its committed figure by more than the tolerance."""

    row: str
    committed: float
    measured: float
    slowdown: float  # 0.08 = 8% slower

    def __str__(self) -> str:
        return f"{self.row}: {self.measured:.4g} against committed {self.committed:.4g} ({self.slowdown:.1%} slower)"


def regressions(
    committed: Mapping[str, float],
    measured: Mapping[str, float],
    *,
    higher_is_better: bool,
    tolerance: float = TOLERANCE,
) -> list[Regression]:
    """Rows of ``measured`` more than ``tolerance`` slower than in ``committed``.

    Args:
        committed: row id -> figure from the committed table.
        measured: row id -> figure of this run (e.g. the median of three runs).
        higher_is_better: True for rates (tok/s), False for times (ms).
        tolerance: the slowdown allowed, as a fraction (0.05 = 5%).

    Returns:
        The slower rows, in ``measured``'s order. Rows missing on either side are not compared.
    """
    out = []
    for rid, now in measured.items():
        before = committed.get(rid)
        if before is None or before <= 0 or now <= 0:
            continue
        slowdown = before / now - 1 if higher_is_better else now / before - 1
        if slowdown > tolerance:
            out.append(Regression(rid, before, now, slowdown))
    return out


def device_mismatch(text: str, device: str) -> str | None:
    """A warning when the committed table's ``**device:**`` line does not name ``device`` (this run's
    GPU, e.g. ``torch.cuda.get_device_name()``): the figures then come from another GPU model, and a 5%
    comparison says little. None when it does, or when the table names no device."""
    line = next((ln for ln in text.splitlines() if ln.startswith("**device:**")), None)
    if line is None or device in line:
        return None
    committed = line.removeprefix("**device:**").split("|")[0].strip()
    return f"check: WARNING: the committed table was measured on {committed}, this run is on {device}"


def report(slower: list[Regression], compared: int, table: str) -> int:
    """Print the verdict of a check and return the exit status (1 when a row is slower)."""
    if not slower:
        print(f"check: {compared} rows within {TOLERANCE:.0%} of {table}")
        return 0
    print(f"check: {len(slower)} of {compared} rows more than {TOLERANCE:.0%} slower than {table}:")
    for r in slower:
        print(f"  SLOWER {r}")
    return 1
