"""Pipelined training on gloo equals single-process training on the whole batch, for every schedule."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from plait.dist_core.testing import run_distributed
from plait.pipelining import (
    Chunk,
    InferenceConfig,
    OfflineExecutor,
    PipelineState,
    Stack,
    build_pipeline,
    parse_schedule_config,
)

from tests.pipelining import _model as M

ATOL = 1e-6


def _run_cases(cases: list[dict], batch: int, device: str = "cpu") -> list[tuple[str, float, float]]:
    """On every rank: run each schedule config and return (case, loss error, max grad error)."""
    torch.set_num_threads(1)
    group = dist.group.WORLD
    pp, rank = dist.get_world_size(), dist.get_rank()
    dev = torch.device(device, torch.cuda.current_device()) if device == "cuda" else torch.device(device)
    out = []
    for case in cases:
        cfg = parse_schedule_config(case)
        topo = cfg.topology(pp)
        ref_loss, ref_grads = M.reference(topo.num_stages, batch)
        mine = {
            s: m.to(dev) for s, m in M.copies(M.make_stages(topo.num_stages), topo.stages_of(rank)).items()
        }
        ex = build_pipeline(cfg, pp_group=group, stage_modules=mine, loss_fn=M.loss_fn)
        ids, labels = (t.to(dev) for t in M.make_batch(batch))
        loss_err = grad_err = 0.0
        for lockstep in (True, False):  # the first step runs in lockstep, later ones overlap communication
            for mod in mine.values():
                mod.zero_grad(set_to_none=True)
            state = PipelineState(cfg.num_microbatches, specs={"labels": Chunk(0), "loss": Stack()})
            state.global_view["labels"] = labels
            res = ex.step({"input_ids": ids}, state)
            assert ex._lockstep is lockstep
            if topo.num_stages - 1 in mine:
                assert res.loss is not None
                loss_err = max(loss_err, (res.loss.cpu() - ref_loss).abs().item())
            else:
                assert res.loss is None
            for s, mod in mine.items():
                for n, p in mod.named_parameters():
                    assert p.grad is not None, f"{case}: stage {s} {n} has no grad"
                    grad_err = max(grad_err, (p.grad.cpu() - ref_grads[s][n]).abs().max().item())
        out.append((str(case), loss_err, grad_err))
    return out


def _check(results: list[list[tuple[str, float, float]]], atol: float = ATOL) -> None:
    for rank, per_rank in enumerate(results):
        for case, loss_err, grad_err in per_rank:
            assert loss_err <= atol and grad_err <= atol, (
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


@pytest.mark.multigpu
@pytest.mark.parametrize(
    "case",
    [*PP2_CASES, {"kind": "looped_bfs", "num_microbatches": 4, "stages_per_rank": 2}],
    ids=lambda c: f"{c['kind']}-m{c['num_microbatches']}",
)
def test_schedules_match_single_process_pp2_on_nccl(case: dict) -> None:
    # Each stage sends two tensors (float activations and an int64 position tensor) per message: with the
    # old grouping of consecutive sends and receives into one NCCL group, 1F1B deadlocked (the second
    # tensor waited behind the gradient receive of the same group). fp32 on GPU vs the CPU reference.
    _check(run_distributed(_run_cases, 2, [case], 8, "cuda", backend="nccl", timeout=60), atol=1e-5)


@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 CUDA devices")
@pytest.mark.parametrize("case", PP4_CASES, ids=lambda c: f"{c['kind']}-m{c['num_microbatches']}")
def test_schedules_match_single_process_pp4_on_nccl(case: dict) -> None:
    # pp=4: a middle rank's groups hold messages for both neighbours.
    _check(run_distributed(_run_cases, 4, [case], 8, "cuda", backend="nccl", timeout=60), atol=1e-5)


def _run_new_shapes() -> list[float]:
    """1F1B on 2 ranks: batch 4, then batch 8 without and with ``new_shapes``; errors vs the reference."""
    torch.set_num_threads(1)
    rank = dist.get_rank()
    cfg = parse_schedule_config({"kind": "1f1b", "num_microbatches": 2})
    mine = M.copies(M.make_stages(2), [rank])
    ex = build_pipeline(cfg, pp_group=dist.group.WORLD, stage_modules=mine, loss_fn=M.loss_fn)
    errs = []
    for batch, new_shapes in ((4, False), (8, False), (8, True)):
        ids, labels = M.make_batch(batch)
        state = PipelineState(2, specs={"labels": Chunk(0), "loss": Stack()})
        state.global_view["labels"] = labels
        for mod in mine.values():
            mod.zero_grad(set_to_none=True)
        if batch == 8 and not new_shapes:
            if rank == 0:  # the sender notices before posting anything; rank 1 does not take part
                with pytest.raises(ValueError, match=r"stage 0's outputs .* new_shapes=True"):
                    ex.step({"input_ids": ids}, state)
            continue
        ex.step({"input_ids": ids}, state, new_shapes=new_shapes)
        _, ref_grads = M.reference(2, batch)
        errs.append(
            max((p.grad - ref_grads[rank][n]).abs().max().item() for n, p in mine[rank].named_parameters())
        )
    return errs


def test_changed_shapes_need_new_shapes() -> None:
    for errs in run_distributed(_run_new_shapes, 2):
        assert len(errs) == 2 and max(errs) <= ATOL, errs


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
    state = PipelineState(m, specs={"labels": Chunk(0), "loss": Stack()})
    state.global_view["labels"] = labels
    res = ex.step({"input_ids": ids}, state)
    assert res.loss is not None
    torch.testing.assert_close(res.loss, ref_loss, atol=ATOL, rtol=0)
    for s, mod in stages.items():
        for n, p in mod.named_parameters():
            torch.testing.assert_close(p.grad, ref_grads[s][n], atol=ATOL, rtol=0)
    assert state.global_view["loss"].shape == (m,)


def _run_forward_program(schedule: dict, m: int, batch: int) -> torch.Tensor | None:
    """Forward-only program of a training schedule's placement, with a loss: the per-microbatch losses."""
    from plait.pipelining import PipelineExecutor, build_forward_program, build_program

    torch.set_num_threads(1)
    pp, rank = dist.get_world_size(), dist.get_rank()
    cfg = parse_schedule_config({**schedule, "num_microbatches": m})
    topo = cfg.topology(pp)
    mine = M.copies(M.make_stages(topo.num_stages), topo.stages_of(rank))
    program = build_forward_program(build_program(cfg, pp))
    assert not program.has_backward and program.topology == topo
    ex = PipelineExecutor(program, mine, dist.group.WORLD, M.loss_fn, loss_reduction="sum")
    ids, labels = M.make_batch(batch)
    state = PipelineState(m, specs={"labels": Chunk(0), "loss": Stack()})
    state.global_view["labels"] = labels
    res = ex.step({"input_ids": ids}, state)
    assert all(p.grad is None for mod in mine.values() for p in mod.parameters())
    return state.global_view["loss"] if res.loss is not None else None


@pytest.mark.parametrize("schedule", [{"kind": "zbv"}, {"kind": "interleaved_1f1b", "stages_per_rank": 2}])
def test_forward_program_on_a_training_placement(schedule: dict) -> None:
    # ZBV places stages in a V (rank 0 holds the first and the last stage): the evaluation program must
    # run on that placement, forward only, and give each microbatch's loss.
    m, batch = 4, 8
    stages = M.make_stages(4)
    ids, labels = M.make_batch(batch)
    want = []
    with torch.no_grad():
        for mb_ids, mb_labels in zip(ids.chunk(m), labels.chunk(m)):
            out = {"input_ids": mb_ids}
            for s in range(4):
                out = stages[s](**out)
            want.append(M.loss_fn(out, {"labels": mb_labels}))
    results = run_distributed(_run_forward_program, 2, schedule, m, batch)
    last_rank = 0 if schedule["kind"] == "zbv" else 1
    assert results[1 - last_rank] is None
    torch.testing.assert_close(results[last_rank], torch.stack(want), atol=ATOL, rtol=0)


def test_offline_executor_forward_only_with_loss() -> None:
    stages = M.make_stages(2)
    ex = OfflineExecutor(stages, M.loss_fn, 2, loss_reduction="sum", forward_only=True)
    ids, labels = M.make_batch(8)
    state = PipelineState(2, specs={"labels": Chunk(0), "loss": Stack()})
    state.global_view["labels"] = labels
    res = ex.step({"input_ids": ids}, state)
    with torch.no_grad():
        out = stages[1](**stages[0](input_ids=ids[:4]))
        want = M.loss_fn(out, {"labels": labels[:4]})
    torch.testing.assert_close(state.global_view["loss"][0], want, atol=ATOL, rtol=0)
    assert res.loss is not None and all(p.grad is None for mod in stages.values() for p in mod.parameters())
