"""Lowering: insert the sends and receives a compute-only program needs (see :func:`lower`)."""

from __future__ import annotations

import bisect
import itertools

from plait.pipelining.actions import Action, ActionKind, AnyAction, CommGroup
from plait.pipelining.program import Program
from plait.pipelining.timing import compute_times, produced_at, unit_cost
from plait.pipelining.topology import StageTopology

__all__ = ["lower", "recvs_for", "sends_for"]

_BWD = (ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT)


def recvs_for(topo: StageTopology, action: AnyAction) -> list[Action]:
    """Receive actions that must complete before `action` can run on its rank."""
    out: list[Action] = []
    for a in action.sub_actions():
        if a.kind is ActionKind.FORWARD and a.stage > 0 and not topo.is_local_edge(a.stage - 1):
            out.append(Action(a.stage, ActionKind.RECV_F, a.microbatch))
        elif a.kind in _BWD and a.stage < topo.num_stages - 1 and not topo.is_local_edge(a.stage):
            out.append(Action(a.stage, ActionKind.RECV_B, a.microbatch))
    return out


def sends_for(topo: StageTopology, action: AnyAction, *, has_backward: bool = True) -> list[Action]:
    """Send actions that forward `action`'s results to a stage on another rank."""
    out: list[Action] = []
    for a in action.sub_actions():
        if a.kind is ActionKind.FORWARD and a.stage < topo.num_stages - 1 and not topo.is_local_edge(a.stage):
            out.append(Action(a.stage, ActionKind.SEND_F, a.microbatch))
        elif has_backward and a.kind in _BWD and a.stage > 0 and not topo.is_local_edge(a.stage - 1):
            out.append(Action(a.stage, ActionKind.SEND_B, a.microbatch))
    return out


def _matching_recv(send: Action) -> Action:
    if send.kind is ActionKind.SEND_F:
        return Action(send.stage + 1, ActionKind.RECV_F, send.microbatch)
    return Action(send.stage - 1, ActionKind.RECV_B, send.microbatch)


def lower(program: Program) -> Program:
    """Return `program` with communication actions inserted (idempotent on lowered programs).

    Each message gets a time: when its producer finishes in a unit-cost run of the program where sends never
    block. The send goes right after the producer; the receive goes before the first compute action the
    receiving rank starts at or after that time. The messages of one instant that a rank sends or receives
    form one :class:`CommGroup`, and each peer holds the same messages of that instant in one group too, so
    groups pair up across ranks (which NCCL needs to progress a group's operations concurrently). Groups run
    in order of their instants on every rank, so the lowered program is deadlock-free even when each rank
    runs its groups strictly one after another on one stream, and each rank pair posts its messages in the
    same order on both ends.

    Raises:
        ValueError: if the compute order has cyclic dependencies across ranks.
    """
    if program.lowered:
        return program
    topo = program.topology
    for acts in program.actions:
        for a in acts:
            if a.is_comm:
                raise ValueError(f"lower(): program {program.name} is not lowered but contains {a}")
    try:
        times = compute_times(program, unit_cost)
    except ValueError as e:
        raise ValueError(f"lower(): program {program.name} cannot run: {e}") from None
    # slot[r][j]: comm actions placed just before rank r's j-th compute action (j == n: after the last)
    slots: list[list[list[tuple[tuple[float, int, int], Action]]]] = [
        [[] for _ in range(len(t) + 1)] for t in times
    ]
    starts = [[st for _, st, _ in t] for t in times]
    for r, per_rank in enumerate(times):
        seq_no = 0
        for j, (i, start, finish) in enumerate(per_rank):
            act = program.actions[r][i]
            for sub in act.sub_actions():
                done = produced_at(act, sub, start, finish, unit_cost)  # an F|B pair's forward: early
                for snd in sends_for(topo, sub, has_backward=program.has_backward):
                    key = (done, r, seq_no)
                    seq_no += 1
                    slots[r][j + 1].append((key, snd))
                    rcv = _matching_recv(snd)
                    dst = topo.rank_of(rcv.stage)
                    at = bisect.bisect_left(starts[dst], done)  # first compute starting at or after `done`
                    slots[dst][at].append((key, rcv))
    ranks: list[list[AnyAction]] = []
    for r, per_rank in enumerate(times):
        seq: list[AnyAction] = []
        for j in range(len(per_rank) + 1):
            for _, grp in itertools.groupby(sorted(slots[r][j], key=lambda x: x[0]), key=lambda x: x[0][0]):
                ops = [a for _, a in grp]
                seq.append(ops[0] if len(ops) == 1 else CommGroup(tuple(ops)))
            if j < len(per_rank):
                seq.append(program.actions[r][per_rank[j][0]])
        ranks.append(seq)
    return Program.from_lists(
        topo,
        program.num_microbatches,
        ranks,
        lowered=True,
        name=program.name,
        has_backward=program.has_backward,
    )
