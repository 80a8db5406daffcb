"""Microbatch counts that are not a multiple of pp, and DualPipeV's reference order, executed on gloo (and
NCCL): loss and gradients equal single-process training on the whole batch."""

from __future__ import annotations

import pytest
from plait.dist_core.testing import run_distributed

from tests.pipelining.test_executor import _check, _run_cases

# (pp, batch, cases): the batch splits evenly into every case's microbatches.
SIZES = [
    (
        2,
        12,
        [
            {"kind": "interleaved_1f1b", "num_microbatches": 3, "stages_per_rank": 2},
            {"kind": "zb1p", "num_microbatches": 3, "stages_per_rank": 1},
            {"kind": "zb1p", "num_microbatches": 3, "stages_per_rank": 2},
            {"kind": "dualpipev", "num_microbatches": 4, "order": "reference"},
            {"kind": "dualpipev", "num_microbatches": 6, "order": "reference"},
        ],
    ),
    (
        3,
        10,
        [
            {"kind": "interleaved_1f1b", "num_microbatches": 5, "stages_per_rank": 2},
            {"kind": "zb1p", "num_microbatches": 5, "stages_per_rank": 1},
            {"kind": "zb1p", "num_microbatches": 5, "stages_per_rank": 2},
        ],
    ),
    (
        4,
        24,
        [
            {"kind": "interleaved_1f1b", "num_microbatches": 6, "stages_per_rank": 2},
            {"kind": "zb1p", "num_microbatches": 6, "stages_per_rank": 2},
            {"kind": "dualpipev", "num_microbatches": 8, "order": "reference"},
        ],
    ),
]


@pytest.mark.parametrize("pp,batch,cases", SIZES, ids=[f"pp{pp}" for pp, _, _ in SIZES])
def test_schedule_sizes_match_single_process(pp: int, batch: int, cases: list[dict]) -> None:
    _check(run_distributed(_run_cases, pp, cases, batch, timeout=300))


@pytest.mark.multigpu
@pytest.mark.parametrize(
    "case", SIZES[0][2], ids=lambda c: f"{c['kind']}-m{c['num_microbatches']}-{c.get('order', '')}"
)
def test_schedule_sizes_match_single_process_pp2_on_nccl(case: dict) -> None:
    # fp32 on GPU vs the CPU reference, as test_executor's NCCL cases.
    _check(run_distributed(_run_cases, 2, [case], SIZES[0][1], "cuda", backend="nccl", timeout=60), atol=1e-5)
