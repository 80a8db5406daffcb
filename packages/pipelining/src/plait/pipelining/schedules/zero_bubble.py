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
from plait.pipelining.topology import StageTopology, loop_topology, vshape_topology

F, B, BI, W = ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT


@dataclass(frozen=True)
class _Policy:
    split_backward: bool  # standalone backwards are I (+ deferred W) instead of B
    overlap: bool  # pair a ready forward with a ready backward (full B) into one OverlapAction
    max_inflight: Callable[[int], int]  # microbatches admitted to a rank's first stage and not yet freed


_COST = {F: 1, B: 2, BI: 1, W: 1}


class _Greedy:
    """The unit-cost simulation of one greedy schedule: what each rank has issued and what is ready."""

    def __init__(self, topo: StageTopology, m: int, policy: _Policy) -> None:
        ns, pp = topo.num_stages, topo.num_ranks
        self.topo, self.m, self.policy = topo, m, policy
        self.done: dict[tuple[ActionKind, int, int], int] = {}  # (F|BWD, stage, mb) -> finish time
        self.next_f = [0] * ns
        self.next_b = [0] * ns
        self.pending_w: list[deque[Action]] = [deque() for _ in range(pp)]
        self.admitted = [0] * pp  # microbatches whose forward entered the rank's first local stage
        self.freed = [0] * pp  # ... and whose memory at that stage was released (B or W done)
        self.first_stage = [min(topo.stages_of(r)) for r in range(pp)]
        self.free_at = [0] * pp
        self.out: list[list[AnyAction]] = [[] for _ in range(pp)]

    def finished(self) -> bool:
        return (
            all(k == self.m for k in self.next_f)
            and all(k == self.m for k in self.next_b)
            and not any(self.pending_w)
        )

    def _f_ready(self, s: int, t: int) -> bool:
        k = self.next_f[s]
        if k >= self.m:
            return False
        return s == 0 or self.done.get((F, s - 1, k), t + 1) <= t

    def _b_ready(self, s: int, t: int) -> bool:
        k = self.next_b[s]
        if k >= self.m or self.done.get((F, s, k), t + 1) > t:
            return False
        return s == self.topo.num_stages - 1 or self.done.get((B, s + 1, k), t + 1) <= t

    def _release(self, r: int, s: int) -> None:
        if s == self.first_stage[r]:
            self.freed[r] += 1

    def _admits(self, r: int, s: int) -> bool:
        """A forward of stage ``s`` fits rank ``r``'s in-flight budget."""
        return s != self.first_stage[r] or self.admitted[r] - self.freed[r] < self.policy.max_inflight(r)

    def step(self, r: int, t: int) -> None:
        """Issue rank ``r``'s most urgent ready operation at time ``t``, if it is idle and has one."""
        if self.free_at[r] > t:
            return
        stages = self.topo.stages_of(r)
        bw = sorted((s for s in stages if self._b_ready(s, t)), key=lambda s: (self.next_b[s], -s))
        fw = [s for s in sorted(stages, reverse=True) if self._f_ready(s, t) and self._admits(r, s)]
        s_f = next((s for s in fw if bw and s != bw[0]), None) if self.policy.overlap else None
        issued: tuple[AnyAction, int] | None
        if s_f is not None:
            issued = self._overlap(r, s_f, bw[0], t)
        elif bw:
            issued = self._backward(r, bw[0], t)
        elif fw:
            issued = self._forward(r, fw[0], t)
        elif self.pending_w[r]:
            issued = self._weight(r)
        else:
            return
        act, dur = issued
        self.out[r].append(act)
        self.free_at[r] = t + dur

    def _overlap(self, r: int, s_f: int, s_b: int, t: int) -> tuple[AnyAction, int]:
        act = OverlapAction(Action(s_f, F, self.next_f[s_f]), Action(s_b, B, self.next_b[s_b]))
        dur = _COST[F] + _COST[B]
        self.done[(F, s_f, self.next_f[s_f])] = t + dur
        self.done[(B, s_b, self.next_b[s_b])] = t + dur
        if s_f == self.first_stage[r]:
            self.admitted[r] += 1
        self._release(r, s_b)
        self.next_f[s_f] += 1
        self.next_b[s_b] += 1
        return act, dur

    def _backward(self, r: int, s: int, t: int) -> tuple[AnyAction, int]:
        kind = BI if self.policy.split_backward else B
        act = Action(s, kind, self.next_b[s])
        self.done[(B, s, self.next_b[s])] = t + _COST[kind]
        if kind is BI:
            self.pending_w[r].append(Action(s, W, self.next_b[s]))
        else:
            self._release(r, s)
        self.next_b[s] += 1
        return act, _COST[kind]

    def _forward(self, r: int, s: int, t: int) -> tuple[AnyAction, int]:
        act = Action(s, F, self.next_f[s])
        self.done[(F, s, self.next_f[s])] = t + _COST[F]
        if s == self.first_stage[r]:
            self.admitted[r] += 1
        self.next_f[s] += 1
        return act, _COST[F]

    def _weight(self, r: int) -> tuple[AnyAction, int]:
        act = self.pending_w[r].popleft()
        self._release(r, act.stage)
        return act, _COST[W]


def _greedy(topo: StageTopology, m: int, policy: _Policy, name: str) -> Program:
    sim = _Greedy(topo, m, policy)
    limit = 20 * topo.num_stages * m * 3 + 100
    t = 0
    while not sim.finished():
        if t > limit:
            raise RuntimeError(f"{name}: greedy scheduler made no progress (internal error)")
        for r in range(topo.num_ranks):
            sim.step(r, t)
        t += 1
    return Program.from_lists(topo, m, sim.out, name=name)


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
