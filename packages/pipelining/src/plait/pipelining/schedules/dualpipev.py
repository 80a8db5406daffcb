"""DualPipeV: V-shape placement with overlapped forward+backward pairs, in two orders.

``"greedy"`` comes from plait's greedy list scheduler (:mod:`plait.pipelining.schedules.zero_bubble`).
``"reference"`` is the step order of DeepSeek's ``DualPipeV.step`` (github.com/deepseek-ai/DualPipe,
``dualpipe/dualpipev.py``; torch.distributed.pipelining's ``ScheduleDualPipeV`` follows it too), written as
plait actions. Rank r holds stage r (leg 0, down the ranks) and stage 2pp-1-r (leg 1, back up); each leg
runs its microbatches in order, and deferred weight gradients (W) run first in, first out.
"""

from __future__ import annotations

from collections import deque
from typing import Literal

from plait.pipelining.actions import Action, ActionKind, AnyAction, OverlapAction
from plait.pipelining.program import Program
from plait.pipelining.schedules.zero_bubble import greedy_dualpipev
from plait.pipelining.topology import vshape_topology

F, B, BI, W = ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT

DualPipeVOrder = Literal["greedy", "reference"]


class _Legs:
    """Per-leg microbatch counters of one rank and its queue of deferred W actions."""

    def __init__(self, pp: int, rank: int) -> None:
        self.stage = (rank, 2 * pp - 1 - rank)
        self.next_f = [0, 0]
        self.next_b = [0, 0]
        self.pending_w: deque[Action] = deque()

    def f(self, leg: int) -> Action:
        self.next_f[leg] += 1
        return Action(self.stage[leg], F, self.next_f[leg] - 1)

    def b(self, leg: int, split: bool = False) -> Action:
        """The leg's next backward: full ``B``, or ``I`` with its ``W`` queued when `split`."""
        self.next_b[leg] += 1
        a = Action(self.stage[leg], BI if split else B, self.next_b[leg] - 1)
        if split:
            self.pending_w.append(Action(a.stage, W, a.microbatch))
        return a

    def w(self) -> Action:
        return self.pending_w.popleft()


def _reference_rank(pp: int, m: int, r: int) -> list[AnyAction]:
    """Rank r's actions in the order of DeepSeek's eight steps."""
    legs = _Legs(pp, r)
    out: list[AnyAction] = [legs.f(0) for _ in range(2 * (pp - r - 1))]  # 1. nF0
    for _ in range(r + 1):  # 2. nF0F1
        out += [legs.f(0), legs.f(1)]
    for _ in range(pp - r - 1):  # 3. nB1W1F1: split backward, its W right away
        out += [legs.b(1, split=True), legs.w(), legs.f(1)]
    for i in range(m - 2 * pp + r + 1):  # 4. nF0B1F1B0: the main loop of overlapped pairs
        if i == 0 and r == pp - 1:  # the last rank does its first pair one after the other (smaller bubble)
            out += [legs.f(0), legs.b(1)]
        else:
            out.append(OverlapAction(legs.f(0), legs.b(1)))
        out.append(OverlapAction(legs.f(1), legs.b(0)))
    for _ in range(pp - r - 1):  # 5. nB1F1B0
        out += [legs.b(1), OverlapAction(legs.f(1), legs.b(0))]
    for j in range(2 * (r + 1)):  # 6. nB1B0, legs alternating; the second half split (W deferred)
        out.append(legs.b(1 - j % 2, split=j > r))
    for _ in range(pp - r - 1):  # 7. nWB0
        out += [legs.w(), legs.b(0, split=True)]
    out += [legs.w() for _ in range(r + 1)]  # 8. nW
    assert not legs.pending_w and legs.next_f == legs.next_b == [m, m]
    return out


def build_dualpipev(pp: int, num_microbatches: int, order: DualPipeVOrder = "greedy") -> Program:
    """DualPipeV: V-shape with overlapped forward+backward (``F|B``) pairs in the steady state.

    Args:
        pp: pipeline size.
        num_microbatches: microbatches per step; must be >= 2 * pp.
        order: ``"greedy"``: plait's list scheduler (standalone backwards split into I and W, W filling
            bubbles); ``"reference"``: DeepSeek's step order (nF0, nF0F1, nB1W1F1, nF0B1F1B0, nB1F1B0, nB1B0,
            nWB0, nW), whose overlapped pairs hold full backwards and whose fill and drain split some.

    Raises:
        ValueError: on a pipeline size < 1, too few microbatches, or an unknown order.
    """
    if pp < 1:
        raise ValueError(f"dualpipev: pipeline size must be >= 1, got {pp}")
    if num_microbatches < 2 * pp:
        raise ValueError(
            f"dualpipev: num_microbatches ({num_microbatches}) must be >= 2 * pipeline size ({2 * pp})"
        )
    if order == "greedy":
        return greedy_dualpipev(pp, num_microbatches)
    if order == "reference":
        acts = [_reference_rank(pp, num_microbatches, r) for r in range(pp)]
        return Program.from_lists(vshape_topology(pp), num_microbatches, acts, name="dualpipev_reference")
    raise ValueError(f"dualpipev: order must be 'greedy' or 'reference', got {order!r}")
