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


def round_sizes(pp: int, m: int) -> list[int]:
    """Microbatches per round of the interleaved schedules: ``max(1, m // pp)`` rounds, larger ones first.

    Each round runs its microbatches through one local stage, then the next (Megatron's microbatch groups,
    torch's ``microbatches_per_round``). When `m` is not a multiple of the round count the first
    ``m % rounds`` rounds take one microbatch more; a round is never smaller than `pp` when ``m >= pp``.
    The warmup is sized by the first round, so a larger round after a smaller one would starve it (the
    order would then have cyclic dependencies).
    """
    rounds = max(1, m // pp)
    base, extra = divmod(m, rounds)
    return [base + 1] * extra + [base] * (rounds - extra)


def interleaved_order(pp: int, m: int, v: int, rank: int) -> tuple[list[Action], list[Action], int]:
    """Megatron's interleaved forward/backward sequences for `rank` and its warmup length.

    Forwards go round by round (see :func:`round_sizes`), within a round local stage by local stage, within
    a stage microbatch by microbatch; backwards take the same order with the local stages reversed. The
    warmup is ``(v - 1) * first_round + 2 * (pp - 1 - rank)`` forwards (capped at ``v * m``).
    """
    table: list[tuple[int, int]] = []  # (local stage, microbatch) in forward order
    start = 0
    sizes = round_sizes(pp, m)
    for size in sizes:
        table += [(c, i) for c in range(v) for i in range(start, start + size)]
        start += size
    fw = [Action(c * pp + rank, F, i) for c, i in table]
    bw = [Action((v - 1 - c) * pp + rank, B, i) for c, i in table]
    return fw, bw, min(v * m, (v - 1) * sizes[0] + 2 * (pp - 1 - rank))


def build_interleaved_1f1b(pp: int, num_microbatches: int, stages_per_rank: int = 2) -> Program:
    """Interleaved 1F1B (Megatron virtual pipeline): any num_microbatches >= pp, in rounds of ``round_sizes``."""
    _check("interleaved_1f1b", pp, num_microbatches)
    if stages_per_rank < 2:
        raise ValueError("interleaved_1f1b: stages_per_rank must be >= 2 (use 1f1b for one stage per rank)")
    if num_microbatches < pp:
        raise ValueError(
            f"interleaved_1f1b: num_microbatches ({num_microbatches}) must be >= the pipeline size ({pp})"
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
