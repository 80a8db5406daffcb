"""Zero-bubble family (ZB1P, ZBV, DualPipeV's greedy order), built by a greedy list scheduler on unit costs.

Each rank, whenever idle in a unit-cost simulation, picks the most urgent ready operation: a backward
(input-gradient part) first, so gradients reach earlier stages quickly; then a forward, if the rank's
in-flight budget allows another microbatch in; and weight-gradient work (W) last, so it fills what
would otherwise be bubbles. The resulting per-rank order is a static program like any other.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from plait.pipelining.actions import Action, ActionKind, AnyAction, OverlapAction
from plait.pipelining.program import Program
from plait.pipelining.topology import Topology, loop_topology, vshape_topology

F, B, BI, W = ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT


@dataclass(frozen=True)
class _Policy:
    split_backward: bool  # standalone backwards are I (+ deferred W) instead of B
    overlap: bool  # pair a ready forward with a ready backward (full B) into one OverlapAction
    max_inflight: Callable[[int], int]  # microbatches admitted to a rank's first stage and not yet freed


def _greedy(topo: Topology, m: int, policy: _Policy, name: str) -> Program:
    ns, pp = topo.num_stages, topo.num_ranks
    cost = {F: 1, B: 2, BI: 1, W: 1}
    done: dict[tuple[ActionKind, int, int], int] = {}  # (F|BWD, stage, mb) -> finish time
    next_f = [0] * ns
    next_b = [0] * ns
    pending_w: list[deque[Action]] = [deque() for _ in range(pp)]
    admitted = [0] * pp  # microbatches whose forward entered the rank's first local stage
    freed = [0] * pp  # ... and whose memory at that stage was released (B or W done)
    first_stage = [min(topo.stages_of(r)) for r in range(pp)]
    free_at = [0] * pp
    out: list[list[AnyAction]] = [[] for _ in range(pp)]
    limit = 20 * ns * m * 3 + 100
    t = 0

    def f_ready(s: int, t: int) -> bool:
        k = next_f[s]
        if k >= m:
            return False
        return s == 0 or done.get((F, s - 1, k), t + 1) <= t

    def b_ready(s: int, t: int) -> bool:
        k = next_b[s]
        if k >= m or done.get((F, s, k), t + 1) > t:
            return False
        return s == ns - 1 or done.get((B, s + 1, k), t + 1) <= t

    def release(r: int, s: int) -> None:
        if s == first_stage[r]:
            freed[r] += 1

    def finished() -> bool:
        return all(k == m for k in next_f) and all(k == m for k in next_b) and not any(pending_w)

    while not finished():
        if t > limit:
            raise RuntimeError(f"{name}: greedy scheduler made no progress (internal error)")
        for r in range(pp):
            if free_at[r] > t:
                continue
            stages = topo.stages_of(r)
            bw = sorted((s for s in stages if b_ready(s, t)), key=lambda s: (next_b[s], -s))
            fw = [
                s
                for s in sorted(stages, reverse=True)
                if f_ready(s, t) and (s != first_stage[r] or admitted[r] - freed[r] < policy.max_inflight(r))
            ]
            act: AnyAction
            if policy.overlap and bw and fw:
                s_f = next((s for s in fw if s != bw[0]), None)
                if s_f is not None:
                    s_b = bw[0]
                    act = OverlapAction(Action(s_f, F, next_f[s_f]), Action(s_b, B, next_b[s_b]))
                    dur = cost[F] + cost[B]
                    done[(F, s_f, next_f[s_f])] = t + dur
                    done[(B, s_b, next_b[s_b])] = t + dur
                    if s_f == first_stage[r]:
                        admitted[r] += 1
                    release(r, s_b)
                    next_f[s_f] += 1
                    next_b[s_b] += 1
                    out[r].append(act)
                    free_at[r] = t + dur
                    continue
            if bw:
                s = bw[0]
                kind = BI if policy.split_backward else B
                act = Action(s, kind, next_b[s])
                done[(B, s, next_b[s])] = t + cost[kind]
                if kind is BI:
                    pending_w[r].append(Action(s, W, next_b[s]))
                else:
                    release(r, s)
                next_b[s] += 1
                dur = cost[kind]
            elif fw:
                s = fw[0]
                act = Action(s, F, next_f[s])
                done[(F, s, next_f[s])] = t + cost[F]
                if s == first_stage[r]:
                    admitted[r] += 1
                next_f[s] += 1
                dur = cost[F]
            elif pending_w[r]:
                act = pending_w[r].popleft()
                release(r, act.stage)
                dur = cost[W]
            else:
                continue
            out[r].append(act)
            free_at[r] = t + dur
        t += 1
    return Program.from_lists(topo, m, out, name=name)


def build_zb1p(pp: int, num_microbatches: int, stages_per_rank: int = 1) -> Program:
    """Interleaved zero bubble (ZB1P): loop topology, backward split into I and W, W delayed into bubbles.

    Requires num_microbatches >= pp (as Interleaved 1F1B).
    """
    if pp < 1 or stages_per_rank < 1:
        raise ValueError(f"zb1p: need pp >= 1 and stages_per_rank >= 1; got {pp}, {stages_per_rank}")
    if num_microbatches < pp:
        raise ValueError(f"zb1p: num_microbatches ({num_microbatches}) must be >= the pipeline size ({pp})")
    v = stages_per_rank
    # Same activation budget as Interleaved 1F1B's warmup on that rank.
    policy = _Policy(True, False, lambda r: (pp - 1 - r) * 2 + (v - 1) * pp + 1 if v > 1 else pp - r)
    return _greedy(loop_topology(pp, v), num_microbatches, policy, "zb1p")


def build_zbv(pp: int, num_microbatches: int) -> Program:
    """ZB-V: V-shape (rank r holds stages r and 2pp-1-r), I/W split; requires num_microbatches >= pp."""
    if pp < 1:
        raise ValueError(f"zbv: pipeline size must be >= 1, got {pp}")
    if num_microbatches < pp:
        raise ValueError(f"zbv: num_microbatches ({num_microbatches}) must be >= the pipeline size ({pp})")
    # At most pp microbatches in flight per rank (2*pp stage-activations, each half a rank's layers): the
    # activation memory of 1F1B, as in the ZB-V paper; a larger budget gives no smaller bubble.
    policy = _Policy(True, False, lambda r: pp)
    return _greedy(vshape_topology(pp), num_microbatches, policy, "zbv")


def greedy_dualpipev(pp: int, num_microbatches: int) -> Program:
    """DualPipeV by the greedy list scheduler (see :func:`plait.pipelining.schedules.build_dualpipev`)."""
    # Twice ZBV's in-flight budget: the overlapped F|B steady state needs a forward ready whenever a
    # backward is (with ZBV's budget the greedy never finds a pair).
    policy = _Policy(True, True, lambda r: 2 * pp)
    return _greedy(vshape_topology(pp), num_microbatches, policy, "dualpipev")
