"""plait's schedules give the same loss and gradients as torch.distributed.pipelining's matching schedules
and as single-process training on the whole batch (fp32, atol 1e-6)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from plait.dist_core.testing import run_distributed
from plait.pipelining import Chunk, PipelineState, Stack, build_pipeline, parse_schedule_config
from torch import nn

from tests.pipelining import _model as M

# plait kind -> torch.distributed.pipelining schedule class name (all exist in torch 2.11 and 2.15)
TORCH_SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "looped_bfs": "ScheduleLoopedBFS",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "zb1p": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}


class _TorchAdapter(nn.Module):
    """torch's PipelineStage passes positional tensors: wrap a dict-in/dict-out stage."""

    def __init__(self, stage: M.Stage) -> None:
        super().__init__()
        self.stage = stage

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.stage.index == 0:
            out = self.stage(input_ids=x)
        else:
            out = self.stage(h=x, pos=torch.arange(x.shape[1]).expand(x.shape[:2]))
        return out["logits"] if "logits" in out else out["h"]


def _torch_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def _compare(cases: list[dict], batch: int) -> list[tuple[str, float, float]]:
    import torch.distributed.pipelining as tpp

    torch.set_num_threads(1)
    pp, rank = dist.get_world_size(), dist.get_rank()
    out = []
    for case in cases:
        cfg = parse_schedule_config(case)
        topo = cfg.topology(pp)
        held = topo.stages_of(rank)
        ids, labels = M.make_batch(batch)
        # plait
        mine = M.copies(M.make_stages(topo.num_stages), held)
        ex = build_pipeline(cfg, pp_group=dist.group.WORLD, stage_modules=mine, loss_fn=M.loss_fn)
        state = PipelineState(cfg.num_microbatches, specs={"labels": Chunk(0), "loss": Stack()})
        state.global_view["labels"] = labels
        res = ex.step({"input_ids": ids}, state)
        # torch
        theirs = {s: _TorchAdapter(m) for s, m in M.copies(M.make_stages(topo.num_stages), held).items()}
        stages = [tpp.PipelineStage(theirs[s], s, topo.num_stages, torch.device("cpu")) for s in held]
        cls = getattr(tpp.schedules, TORCH_SCHEDULES[cfg.kind])
        m = cfg.num_microbatches
        sched = cls(stages if len(stages) > 1 or cfg.kind in ("looped_bfs", "zb1p") else stages[0], m,
                    loss_fn=_torch_loss)  # fmt: skip
        losses: list[torch.Tensor] = []
        kwargs = {}
        if 0 in held:
            kwargs["x"] = ids
        if topo.num_stages - 1 in held:
            kwargs["target"] = labels
            kwargs["losses"] = losses
        args = (kwargs.pop("x"),) if "x" in kwargs else ()
        sched.step(*args, **kwargs)
        ref_loss, ref_grads = M.reference(topo.num_stages, batch)  # single process, whole batch
        loss_err = 0.0
        if topo.num_stages - 1 in held:
            assert res.loss is not None
            loss_err = max(
                (res.loss - torch.stack(losses).mean()).abs().item(), (res.loss - ref_loss).abs().item()
            )
        grad_err = 0.0
        for s in held:
            for (n, p), (_, q) in zip(mine[s].named_parameters(), theirs[s].stage.named_parameters()):
                assert p.grad is not None and q.grad is not None, f"{case} stage {s} {n}"
                grad_err = max(
                    grad_err,
                    (p.grad - q.grad).abs().max().item(),
                    (p.grad - ref_grads[s][n]).abs().max().item(),
                )
        out.append((str(case), loss_err, grad_err))
    return out


def test_same_as_torch_pipelining_pp2() -> None:
    cases = [
        {"kind": "gpipe", "num_microbatches": 4},
        {"kind": "1f1b", "num_microbatches": 4},
        {"kind": "looped_bfs", "num_microbatches": 4, "stages_per_rank": 2},
        {"kind": "interleaved_1f1b", "num_microbatches": 4, "stages_per_rank": 2},
        {"kind": "zb1p", "num_microbatches": 4, "stages_per_rank": 2},
        {"kind": "zbv", "num_microbatches": 4},
        {"kind": "dualpipev", "num_microbatches": 4},
    ]
    for rank, per_rank in enumerate(run_distributed(_compare, 2, cases, 8)):
        for case, loss_err, grad_err in per_rank:
            assert loss_err <= 1e-6 and grad_err <= 1e-6, f"rank {rank} {case}: {loss_err}, {grad_err}"
