"""Pipeline x FSDP2: pp=2 x dp=2 on gloo gives the single-process gradients of the global batch."""

from __future__ import annotations

import pytest
import torch
from plait.dist_core.testing import run_distributed
from plait.pipelining import Chunk, PipelineState, Stack, build_pipeline, parse_schedule_config

from tests.pipelining import _model as M


def _pp_fsdp(cases: list[dict], batch: int) -> list[tuple[str, float]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    out = []
    for case in cases:
        cfg = parse_schedule_config(case)
        topo = cfg.topology(2)
        _, ref_grads = M.reference(topo.num_stages, batch)
        mine = M.copies(M.make_stages(topo.num_stages), topo.stages_of(pp_rank))
        for mod in mine.values():
            fully_shard(mod, mesh=mesh["dp"])
        ex = build_pipeline(cfg, pp_group=mesh["pp"].get_group(), stage_modules=mine, loss_fn=M.loss_fn)
        ids, labels = M.make_batch(batch)
        half = batch // 2
        ids, labels = (
            ids[dp_rank * half : (dp_rank + 1) * half],
            labels[dp_rank * half : (dp_rank + 1) * half],
        )
        state = PipelineState(cfg.num_microbatches, specs={"labels": Chunk(0), "loss": Stack()})
        state.global_view["labels"] = labels
        ex.step({"input_ids": ids}, state)
        err = 0.0
        for s, mod in mine.items():
            for n, p in mod.named_parameters():
                assert p.grad is not None, f"{case}: stage {s} {n} has no grad"
                err = max(err, (p.grad.full_tensor() - ref_grads[s][n]).abs().max().item())
        out.append((str(case), err))
    return out


@pytest.mark.slow
def test_pipeline_with_fsdp2() -> None:
    cases = [{"kind": "1f1b", "num_microbatches": 2}, {"kind": "zbv", "num_microbatches": 2}]
    for rank, per_rank in enumerate(run_distributed(_pp_fsdp, 4, cases, 8)):
        for case, err in per_rank:
            assert err <= 1e-6, f"rank {rank} {case}: grad err {err}"


def _offline_fsdp(m: int, batch: int) -> tuple[float, list[bool]]:
    """pp=1, dp=2: OfflineExecutor over FSDP2 stages; gradient sync per microbatch backward, grad error."""
    from plait.pipelining import OfflineExecutor
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    dp_rank = mesh.get_local_rank()
    _, ref_grads = M.reference(2, batch)
    stages = M.make_stages(2)
    for mod in stages.values():
        fully_shard(mod, mesh=mesh)
    syncs: list[bool] = []
    root = stages[0]
    original = root.set_requires_gradient_sync

    def record(flag: bool, **kw) -> None:  # type: ignore[no-untyped-def]
        syncs.append(flag)
        original(flag, **kw)

    root.set_requires_gradient_sync = record  # type: ignore[method-assign]
    ex = OfflineExecutor(stages, M.loss_fn, m)
    ids, labels = M.make_batch(batch)
    half = batch // 2
    state = PipelineState(m, specs={"labels": Chunk(0), "loss": Stack()})
    state.global_view["labels"] = labels[dp_rank * half : (dp_rank + 1) * half]
    ex.step({"input_ids": ids[dp_rank * half : (dp_rank + 1) * half]}, state)
    err = 0.0
    for s, mod in stages.items():
        for n, p in mod.named_parameters():
            # loss_reduction="mean" per rank, FSDP averages over dp: the global-batch mean gradient
            err = max(err, (p.grad.full_tensor() - ref_grads[s][n]).abs().max().item())
    return err, syncs


def test_offline_executor_reduces_fsdp_gradients_in_the_last_microbatch_only() -> None:
    for err, syncs in run_distributed(_offline_fsdp, 2, 4, 8):
        assert err <= 1e-6
        # off before the step, off for microbatches 0-2, on for the last one, on again after the step
        assert syncs == [False, False, False, False, True, True], syncs
