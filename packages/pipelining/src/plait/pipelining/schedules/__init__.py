"""Program builders: one function per schedule, each returning the per-rank compute order."""

from plait.pipelining.schedules.basic import (
    build_1f1b,
    build_gpipe,
    build_inference,
    build_interleaved_1f1b,
    build_looped_bfs,
    round_sizes,
)
from plait.pipelining.schedules.dualpipev import DualPipeVOrder, build_dualpipev
from plait.pipelining.schedules.zero_bubble import build_zb1p, build_zbv

__all__ = [
    "DualPipeVOrder",
    "build_1f1b",
    "build_dualpipev",
    "build_gpipe",
    "build_inference",
    "build_interleaved_1f1b",
    "build_looped_bfs",
    "build_zb1p",
    "build_zbv",
    "round_sizes",
]
