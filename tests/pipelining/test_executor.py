"""Pipelined training on gloo equals single-process training on the whole batch, for every schedule."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from plait.dist_core.testing import run_distributed
from plait.pipelining import (
    InferenceConfig,
    OfflineExecutor,
    PipelineState,
    Split,
    Stack,
    build_pipeline,
    parse_schedule_config,
)

from tests.pipelining import _model as M

ATOL = 1e-6


def _run_cases(cases: list[dict], batch: int) -> list[tuple[str, float, float]]:
    """On every rank: run each schedule config and return (case, loss error, max grad error)."""
    torch.set_num_threads(1)
    group = dist.group.WORLD
    pp, rank = dist.get_world_size(), dist.get_rank()
    out = []
    for case in cases:
        cfg = parse_schedule_config(case)
        topo = cfg.topology(pp)
        ref_loss, ref_grads = M.reference(topo.num_stages, batch)
        mine = M.copies(M.make_stages(topo.num_stages), topo.stages_of(rank))
        ex = build_pipeline(cfg, pp_group=group, stage_modules=mine, loss_fn=M.loss_fn)
        ids, labels = M.make_batch(batch)
        loss_err = grad_err = 0.0
        for lockstep in (True, False):  # the first step runs in lockstep, later ones overlap communication
            for mod in mine.values():
                mod.zero_grad(set_to_none=True)
            state = PipelineState(cfg.num_microbatches, specs={"labels": Split(0), "loss": Stack()})
            state.global_view["labels"] = labels
            res = ex.step({"input_ids": ids}, state)
            assert ex._lockstep is lockstep
            if topo.num_stages - 1 in mine:
                assert res.loss is not None
                loss_err = max(loss_err, (res.loss - ref_loss).abs().item())
            else:
                assert res.loss is None
            for s, mod in mine.items():
                for n, p in mod.named_parameters():
                    assert p.grad is not None, f"{case}: stage {s} {n} has no grad"
                    grad_err = max(grad_err, (p.grad - ref_grads[s][n]).abs().max().item())
        out.append((str(case), loss_err, grad_err))
    return out


def _check(results: list[list[tuple[str, float, float]]]) -> None:
    for rank, per_rank in enumerate(results):
        for case, loss_err, grad_err in per_rank:
            assert loss_err <= ATOL and grad_err <= ATOL, (
                f"rank {rank} {case}: loss err {loss_err}, grad err {grad_err}"
            )


# Cases torch has no match for, or other microbatch counts / stages per rank than test_torch_reference.py
# (which checks one configuration of every schedule against both torch and the single-process reference).
PP2_CASES = [
    {"kind": "gpipe", "num_microbatches": 1},
    {"kind": "1f1b", "num_microbatches": 8},
    {"kind": "interleaved_1f1b", "num_microbatches": 2, "stages_per_rank": 3},
    {"kind": "zb1p", "num_microbatches": 2, "stages_per_rank": 1},
    {"kind": "zbv", "num_microbatches": 8},
    {"kind": "dualpipev", "num_microbatches": 8},
]

PP4_CASES = [
    {"kind": "1f1b", "num_microbatches": 4},
    {"kind": "interleaved_1f1b", "num_microbatches": 4, "stages_per_rank": 2},
    {"kind": "zbv", "num_microbatches": 4},
    {"kind": "dualpipev", "num_microbatches": 8},
]


def test_schedules_match_single_process_pp2() -> None:
    _check(run_distributed(_run_cases, 2, PP2_CASES, 8))


def test_schedules_match_single_process_pp4() -> None:
    _check(run_distributed(_run_cases, 4, PP4_CASES, 8))


def _run_inference(m: int, batch: int) -> torch.Tensor | None:
    pp, rank = dist.get_world_size(), dist.get_rank()
    cfg = InferenceConfig(num_microbatches=m, stages_per_rank=2)
    topo = cfg.topology(pp)
    mine = M.copies(M.make_stages(topo.num_stages), topo.stages_of(rank))
    ex = build_pipeline(cfg, pp_group=dist.group.WORLD, stage_modules=mine)
    ids, _ = M.make_batch(batch)
    state = PipelineState(m)
    ex.step({"input_ids": ids}, state)
    return state.global_view["logits"] if topo.num_stages - 1 in mine else None


def test_inference_matches_single_process() -> None:
    stages = M.make_stages(4)
    ids, _ = M.make_batch(8)
    out = {"input_ids": ids}
    with torch.no_grad():
        for s in range(4):
            out = stages[s](**out)
    res = run_distributed(_run_inference, 2, 4, 8)
    assert res[0] is None  # the last stage (3) lives on rank 1 = 3 % 2
    torch.testing.assert_close(res[1], out["logits"], atol=ATOL, rtol=0)


@pytest.mark.parametrize("m", [1, 4])
def test_offline_executor_matches_whole_batch(m: int) -> None:
    ref_loss, ref_grads = M.reference(3, 8)
    stages = M.make_stages(3)
    ex = OfflineExecutor(stages, M.loss_fn, m)
    ids, labels = M.make_batch(8)
    state = PipelineState(m, specs={"labels": Split(0), "loss": Stack()})
    state.global_view["labels"] = labels
    res = ex.step({"input_ids": ids}, state)
    assert res.loss is not None
    torch.testing.assert_close(res.loss, ref_loss, atol=ATOL, rtol=0)
    for s, mod in stages.items():
        for n, p in mod.named_parameters():
            torch.testing.assert_close(p.grad, ref_grads[s][n], atol=ATOL, rtol=0)
    assert state.global_view["loss"].shape == (m,)
