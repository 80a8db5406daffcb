"""``python -m plait.model_state inspect DIR`` and ``... diff A B``.

Exit codes: 0 success (``diff``: same), 1 ``diff``: the checkpoints differ, 2 an error (missing
file, unreadable checkpoint: one line on stderr naming it).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from typing import TextIO

import torch

from .errors import ModelStateError
from .reader import CheckpointReader

__all__ = ["main"]


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def inspect(path: str, out: TextIO | None = None) -> int:
    """Print keys, dtypes, shapes and files of a checkpoint, then totals."""
    write = (out or sys.stdout).write
    with CheckpointReader(path) as r:
        width = max((len(k) for k in r.specs), default=3)
        write(f"{'key':<{width}}  {'dtype':<14} {'shape':<22} file\n")
        for k in sorted(r.specs):
            s = r.specs[k]
            write(
                f"{k:<{width}}  {str(s.dtype).removeprefix('torch.'):<14} {list(s.shape)!s:<22} {r.file_of(k).name}\n"
            )
        total = sum(s.nbytes for s in r.specs.values())
        params = sum(s.numel for s in r.specs.values())
        write(f"\n{len(r.specs)} tensors, {params:,} elements, {_human(total)} in {len(r.files)} file(s)\n")
        for f in r.files:
            write(f"  {f.name}\n")
        meta = r.metadata()
        if meta:
            write(f"metadata: {meta}\n")
    return 0


def _max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest absolute difference of two same-shape tensors; equal values (inf and inf, NaN and NaN
    at the same position) count 0, a non-finite value against another value counts inf."""
    if not a.numel():
        return 0.0
    x, y = a.double(), b.double()
    same = (x == y) | (x.isnan() & y.isnan())
    return float((x - y).abs().masked_fill(same, 0.0).nan_to_num(nan=math.inf, posinf=math.inf).max())


def diff(a: str, b: str, atol: float = 0.0, out: TextIO | None = None) -> int:
    """Compare two checkpoints tensor by tensor (streamed); 1 if they differ, else 0."""
    write = (out or sys.stdout).write
    differs = False
    with CheckpointReader(a) as ra, CheckpointReader(b) as rb:
        only_a = sorted(set(ra.specs) - set(rb.specs))
        only_b = sorted(set(rb.specs) - set(ra.specs))
        for k in only_a:
            write(f"only in A: {k}\n")
        for k in only_b:
            write(f"only in B: {k}\n")
        differs = bool(only_a or only_b)
        worst = 0.0
        compared = 0
        for k in sorted(set(ra.specs) & set(rb.specs)):
            sa, sb = ra.specs[k], rb.specs[k]
            if sa.shape != sb.shape or sa.dtype != sb.dtype:
                write(f"spec differs: {k}: A {sa} vs B {sb}\n")
                differs = True
                if sa.shape != sb.shape:
                    continue
            ta, tb = ra.read(k), rb.read(k)
            compared += 1
            if ta.dtype == torch.bool or tb.dtype == torch.bool:
                d = float((ta != tb).sum())
            else:
                d = _max_abs_diff(ta, tb)
            worst = max(worst, d)
            if d > atol:
                write(f"values differ: {k}: max abs diff {d:.6g}\n")
                differs = True
        common = len(set(ra.specs) & set(rb.specs))
        values = (
            f"max abs diff {worst:.6g} over {compared} compared"
            if compared
            else "no tensors were comparable (no common key with the same shape): values not compared"
        )
        write(f"{common} common tensors, {len(only_a)} only in A, {len(only_b)} only in B, {values}\n")
    write("DIFFERENT\n" if differs else "SAME\n")
    return 1 if differs else 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m plait.model_state``."""
    parser = argparse.ArgumentParser(prog="python -m plait.model_state", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("inspect", help="list keys, dtypes, shapes, files and total size")
    p.add_argument("path")
    p = sub.add_parser("diff", help="compare two checkpoints; exit code 1 when they differ")
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--atol", type=float, default=0.0, help="largest absolute difference still counted equal")
    args = parser.parse_args(argv)
    try:
        if args.cmd == "inspect":
            return inspect(args.path)
        return diff(args.a, args.b, args.atol)
    except (ModelStateError, OSError) as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
