"""Fixed-pattern schedules: GPipe, LoopedBFS, 1F1B, Interleaved 1F1B (Megatron order), inference."""

from __future__ import annotations

from plait.pipelining.actions import Action, ActionKind, AnyAction
from plait.pipelining.program import Program
from plait.pipelining.topology import loop_topology

F, B = ActionKind.FORWARD, ActionKind.BACKWARD


def _check(name: str, pp: int, m: int) -> None:
    if pp < 1:
        raise ValueError(f"{name}: pipeline size must be >= 1, got {pp}")
    if m < 1:
        raise ValueError(f"{name}: num_microbatches must be >= 1, got {m}")


def build_gpipe(pp: int, num_microbatches: int) -> Program:
    """All forwards, then all backwards (one stage per rank)."""
    _check("gpipe", pp, num_microbatches)
    m = num_microbatches
    acts = [[Action(r, F, i) for i in range(m)] + [Action(r, B, i) for i in range(m)] for r in range(pp)]
    return Program.from_lists(loop_topology(pp), m, acts, name="gpipe")


def build_looped_bfs(pp: int, num_microbatches: int, stages_per_rank: int = 1) -> Program:
    """Breadth-first over local stages: every microbatch through a stage before the next stage."""
    _check("looped_bfs", pp, num_microbatches)
    topo = loop_topology(pp, stages_per_rank)
    m = num_microbatches
    acts: list[list[AnyAction]] = []
    for r in range(pp):
        stages = topo.stages_of(r)
        seq: list[AnyAction] = [Action(s, F, i) for s in stages for i in range(m)]
        seq += [Action(s, B, i) for s in reversed(stages) for i in range(m)]
        acts.append(seq)
    return Program.from_lists(topo, m, acts, name="looped_bfs")


def build_1f1b(pp: int, num_microbatches: int) -> Program:
    """One-forward-one-backward: rank r warms up with pp-1-r forwards, then alternates."""
    _check("1f1b", pp, num_microbatches)
    m = num_microbatches
    acts: list[list[AnyAction]] = []
    for r in range(pp):
        warm = min(pp - 1 - r, m)
        seq: list[AnyAction] = [Action(r, F, i) for i in range(warm)]
        for i in range(m - warm):
            seq += [Action(r, F, warm + i), Action(r, B, i)]
        seq += [Action(r, B, i) for i in range(m - warm, m)]
        acts.append(seq)
    return Program.from_lists(loop_topology(pp), m, acts, name="1f1b")


def interleaved_order(pp: int, m: int, v: int, rank: int) -> tuple[list[Action], list[Action], int]:
    """Megatron's interleaved forward/backward sequences for `rank` and its warmup length."""
    n = v * m

    def fwd(k: int) -> Action:
        chunk = (k // pp) % v
        return Action(chunk * pp + rank, F, (k // (pp * v)) * pp + k % pp)

    def bwd(k: int) -> Action:
        chunk = v - 1 - (k // pp) % v
        return Action(chunk * pp + rank, B, (k // (pp * v)) * pp + k % pp)

    warm = min(n, (pp - rank - 1) * 2 + (v - 1) * pp)
    return [fwd(k) for k in range(n)], [bwd(k) for k in range(n)], warm


def build_interleaved_1f1b(pp: int, num_microbatches: int, stages_per_rank: int = 2) -> Program:
    """Interleaved 1F1B (Megatron virtual pipeline): requires num_microbatches % pp == 0."""
    _check("interleaved_1f1b", pp, num_microbatches)
    if stages_per_rank < 2:
        raise ValueError("interleaved_1f1b: stages_per_rank must be >= 2 (use 1f1b for one stage per rank)")
    if num_microbatches % pp != 0:
        raise ValueError(
            f"interleaved_1f1b: num_microbatches ({num_microbatches}) must be a multiple of the pipeline size ({pp})"
        )
    m, v = num_microbatches, stages_per_rank
    acts: list[list[AnyAction]] = []
    for r in range(pp):
        fw, bw, warm = interleaved_order(pp, m, v, r)
        n = len(fw)
        seq: list[AnyAction] = list(fw[:warm])
        for k in range(n - warm):
            seq += [fw[warm + k], bw[k]]
        seq += bw[n - warm :]
        acts.append(seq)
    return Program.from_lists(loop_topology(pp, v), m, acts, name="interleaved_1f1b")


def build_inference(pp: int, num_microbatches: int, stages_per_rank: int = 1) -> Program:
    """Forward only; each rank runs its stages breadth-first (every microbatch through one stage, then the next)."""
    _check("inference", pp, num_microbatches)
    topo = loop_topology(pp, stages_per_rank)
    m = num_microbatches
    acts = [[Action(s, F, i) for s in topo.stages_of(r) for i in range(m)] for r in range(pp)]
    return Program.from_lists(topo, m, acts, name="inference", has_backward=False)
