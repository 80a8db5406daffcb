"""FSDP2 weight gathering once per step (``fsdp_gather_once``, MaxText's ``all_gather_over_fsdp``) on gloo.

Each stage is ``fully_shard``-ed per block and at the stage root over a dp=2 mesh; the run takes two steps
with an SGD update between them. With the option every FSDP2 module is all-gathered once per step (without
it: at least once per microbatch), the losses and gradients equal the option-off run and a single-process
float64 reference, and after each step every parameter is sharded again with its unsharded storage freed.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from plait.dist_core.testing import run_distributed
from plait.pipelining import Chunk, PipelineState, Stack, build_pipeline, parse_schedule_config

from tests.pipelining import _model as M

LR, BATCH, STEPS = 0.1, 8, 2


def _reference(num_stages: int) -> list[tuple[float, dict[int, dict[str, torch.Tensor]]]]:
    """Loss and gradients of each step of the whole model on the whole batch, float64, one process."""
    stages = {s: m.double() for s, m in M.make_stages(num_stages).items()}
    params = [p for m in stages.values() for p in m.parameters()]
    out = []
    for step in range(STEPS):
        ids, labels = M.make_batch(BATCH, seed=1 + step)
        x: dict[str, Any] = {"input_ids": ids}
        for s in range(num_stages):
            x = stages[s](**x)
        loss = F.cross_entropy(x["logits"].flatten(0, 1), labels.flatten())
        loss.backward()
        out.append(
            (
                loss.item(),
                {s: {n: p.grad.clone() for n, p in m.named_parameters()} for s, m in stages.items()},
            )
        )
        with torch.no_grad():
            for p in params:
                p -= LR * p.grad
                p.grad = None
    return out


def _sharded_stages(
    pp: int, case: dict[str, Any]
) -> tuple[Any, dict[int, M.Stage], dict[str, Any], Counter[str]]:
    """This rank's stages, ``fully_shard``-ed per block and at the root over dp=2; its mesh, its FSDP2
    modules by ``"<stage>.<module>"`` and the all-gathers each of them runs (counted from here on)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (pp, 2), mesh_dim_names=("pp", "dp"))
    num_stages = 2 if pp == 1 else parse_schedule_config(case).topology(pp).num_stages
    pp_rank = mesh["pp"].get_local_rank()
    keep = range(num_stages) if pp == 1 else parse_schedule_config(case).topology(pp).stages_of(pp_rank)
    mine = M.copies(M.make_stages(num_stages), keep)
    gathers: Counter[str] = Counter()

    class Counting(DefaultAllGather):
        def __init__(self, key: str) -> None:
            self.key = key

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            gathers[self.key] += 1
            return super().__call__(*args, **kwargs)

    for stage in mine.values():
        fully_shard(stage.block, mesh=mesh["dp"])
        fully_shard(stage, mesh=mesh["dp"])
    fsdp = {
        f"{s}.{n or 'root'}": m
        for s, st in mine.items()
        for n, m in st.named_modules()
        if isinstance(m, FSDPModule)
    }
    for key, m in fsdp.items():
        m.set_custom_all_gather(Counting(key))
    return mesh, mine, fsdp, gathers


def _resharded(stages: dict[int, M.Stage], fsdp: dict[str, Any]) -> dict[str, bool]:
    """Whether every parameter is its sharded DTensor again, and every unsharded storage freed."""
    from torch.distributed.tensor import DTensor

    groups = [g for m in fsdp.values() for g in m._get_fsdp_state()._fsdp_param_groups]
    return {
        "sharded": all(isinstance(p, DTensor) for m in stages.values() for p in m.parameters()),
        "freed": all(
            fp.unsharded_param.untyped_storage().size() == 0 for g in groups for fp in g.fsdp_params
        ),
    }


def _train(pp: int, case: dict[str, Any], modes: list[bool]) -> list[dict[str, Any]]:
    """pp x dp=2 ranks: one step per entry of ``modes`` (``fsdp_gather_once`` of that step's executor)."""
    mesh, mine, fsdp, gathers = _sharded_stages(pp, case)
    cfg = parse_schedule_config(case)
    dp_rank = mesh["dp"].get_local_rank()
    executors = {
        once: build_pipeline(
            cfg,
            pp_group=mesh["pp"].get_group() if pp > 1 else None,
            stage_modules=mine,
            loss_fn=M.loss_fn,
            fsdp_gather_once=once,
        )
        for once in set(modes)
    }
    opt = torch.optim.SGD([p for m in mine.values() for p in m.parameters()], lr=LR)
    half = BATCH // 2
    out = []
    for step, once in enumerate(modes):
        ids, labels = M.make_batch(BATCH, seed=1 + step)
        rows = slice(dp_rank * half, (dp_rank + 1) * half)
        state = PipelineState(cfg.num_microbatches, specs={"labels": Chunk(0), "loss": Stack()})
        state.global_view["labels"] = labels[rows]
        gathers.clear()
        loss = executors[once].step({"input_ids": ids[rows]}, state).loss
        out.append(
            {
                "loss": None if loss is None else loss.item(),
                "grads": {
                    s: {n: p.grad.full_tensor() for n, p in m.named_parameters()} for s, m in mine.items()
                },
                "gathers": dict(gathers),
                **_resharded(mine, fsdp),
            }
        )
        opt.step()
        opt.zero_grad()
    return out


def _check_numerics(per_rank: list[list[dict[str, Any]]], num_stages: int, label: str) -> None:
    ref = _reference(num_stages)
    for step, (ref_loss, ref_grads) in enumerate(ref):
        losses = [r[step]["loss"] for r in per_rank if r[step]["loss"] is not None]
        # each dp rank's loss is the mean over its half of the batch: the global loss is their mean
        assert abs(sum(losses) / len(losses) - ref_loss) <= 1e-5, (
            f"{label} step {step}: {losses} vs {ref_loss}"
        )
        for rank, r in enumerate(per_rank):
            for s, grads in r[step]["grads"].items():
                for n, g in grads.items():
                    err = (g.double() - ref_grads[s][n]).abs().max().item()
                    assert err <= 1e-5, f"{label} rank {rank} step {step} stage {s} {n}: grad err {err}"


def _check_resharded(per_rank: list[list[dict[str, Any]]], label: str) -> None:
    for rank, r in enumerate(per_rank):
        for step, rec in enumerate(r):
            assert rec["sharded"] and rec["freed"], (
                f"{label} rank {rank} step {step}: parameters left unsharded"
            )


def test_offline_executor_gathers_each_fsdp_module_once_per_step() -> None:
    """pp=1, dp=2, 4 microbatches (gradient accumulation): the per-backward reduction path."""
    case = {"kind": "1f1b", "num_microbatches": 4}
    on = run_distributed(_train, 2, 1, case, [True] * STEPS)
    off = run_distributed(_train, 2, 1, case, [False] * STEPS)
    _check_numerics(on, 2, "gather-once")
    _check_numerics(off, 2, "per-microbatch")
    _check_resharded(on, "gather-once")
    for rank in range(2):
        for step in range(STEPS):
            a, b = on[rank][step], off[rank][step]
            assert a["loss"] == b["loss"], f"rank {rank} step {step}: {a['loss']} != {b['loss']}"
            for s in a["grads"]:
                for n in a["grads"][s]:
                    assert torch.equal(a["grads"][s][n], b["grads"][s][n]), f"rank {rank} step {step} {s}.{n}"
            keys = {"0.root", "0.block", "1.root", "1.block"}
            assert a["gathers"] == dict.fromkeys(keys, 1), a["gathers"]
            # without the option each module is gathered in every microbatch's forward, blocks again in backward
            assert b["gathers"] == {"0.root": 4, "0.block": 8, "1.root": 4, "1.block": 8}, b["gathers"]


def test_gather_once_restores_the_modules_resharding() -> None:
    """After a gather-once step the same modules behave as configured again under a plain executor."""
    case = {"kind": "1f1b", "num_microbatches": 4}
    mixed = run_distributed(_train, 2, 1, case, [True, False])
    plain = run_distributed(_train, 2, 1, case, [False, False])
    for rank in range(2):
        assert mixed[rank][0]["gathers"] == dict.fromkeys(plain[rank][0]["gathers"], 1)
        assert mixed[rank][1]["gathers"] == plain[rank][1]["gathers"], (mixed[rank][1], plain[rank][1])
        assert mixed[rank][1]["loss"] == plain[rank][1]["loss"]


def _evaluate(once: bool) -> dict[str, Any]:
    """pp=1, dp=2: a forward-only step of 4 microbatches (evaluation)."""
    from plait.pipelining import OfflineExecutor

    mesh, stages, fsdp, gathers = _sharded_stages(1, {"kind": "1f1b", "num_microbatches": 4})
    half = BATCH // 2
    rows = slice(mesh["dp"].get_local_rank() * half, (mesh["dp"].get_local_rank() + 1) * half)
    ids, labels = M.make_batch(BATCH, seed=1)
    state = PipelineState(4, specs={"labels": Chunk(0), "loss": Stack()})
    state.global_view["labels"] = labels[rows]
    ex = OfflineExecutor(stages, M.loss_fn, 4, forward_only=True, fsdp_gather_once=once)
    loss = ex.step({"input_ids": ids[rows]}, state).loss
    assert loss is not None
    return {"loss": loss.item(), "gathers": dict(gathers), **_resharded(stages, fsdp)}


def test_forward_only_step_gathers_once_and_reshards() -> None:
    ref_loss = _reference(2)[0][0]
    on, off = run_distributed(_evaluate, 2, True), run_distributed(_evaluate, 2, False)
    for rank in range(2):
        assert on[rank]["loss"] == off[rank]["loss"]
        assert on[rank]["gathers"] == {"0.root": 1, "0.block": 1, "1.root": 1, "1.block": 1}, on[rank]
        # FSDP keeps a root's parameters after forward; the blocks are gathered per microbatch
        assert off[rank]["gathers"] == {"0.root": 1, "0.block": 4, "1.root": 1, "1.block": 4}, off[rank]
        assert on[rank]["sharded"] and on[rank]["freed"], on[rank]
    assert abs(sum(r["loss"] for r in on) / 2 - ref_loss) <= 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["1f1b", "zbv", "dualpipev"])
def test_pipeline_with_per_layer_fsdp2(kind: str) -> None:
    """PP2 x FSDP2 on 4 gloo ranks, manual backward finalisation; zbv and dualpipev split the backward.

    Split-backward schedules keep the parameters gathered with the option off too: their W pass
    differentiates w.r.t. the parameters a stage holds at its I pass, which a block resharded after a
    later microbatch's forward no longer holds (its weight gradients were lost before: None or wrong).
    """
    case = {"kind": kind, "num_microbatches": 4}
    num_stages = parse_schedule_config(case).topology(2).num_stages
    edge = (0, num_stages - 1)  # the stages whose root holds parameters of its own (embedding, head)
    for once in (True, False):
        runs = run_distributed(_train, 4, 2, case, [once] * STEPS)
        _check_numerics(runs, num_stages, f"{kind} once={once}")
        _check_resharded(runs, f"{kind} once={once}")
        for rank, r in enumerate(runs):
            for step, rec in enumerate(r):
                # with the option off, 1F1B gathers a block in each forward (resharded after it) and once
                # more in its first backward (kept until the step's finalisation): microbatches + 1 times
                block = 1 if once or kind != "1f1b" else case["num_microbatches"] + 1
                want = {f"{s}.block": block for s in rec["grads"]} | {
                    f"{s}.root": 1 for s in rec["grads"] if s in edge
                }
                assert rec["gathers"] == want, f"{kind} once={once} rank {rank} step {step}: {rec['gathers']}"
