"""Dependency-driven timing of a program's compute actions (shared by lowering and the simulator)."""

from __future__ import annotations

from collections.abc import Callable

from plait.pipelining.actions import Action, ActionKind, AnyAction, OverlapAction
from plait.pipelining.program import Program
from plait.pipelining.topology import StageTopology

F, B, BI, W = ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT
_Key = tuple[str, int, int]  # ("F" | "BWD" | "W", stage, microbatch)


def _key(kind: ActionKind, stage: int, mb: int) -> _Key:
    return ("F" if kind is F else "W" if kind is W else "BWD", stage, mb)


def _needs(x: Action, topo: StageTopology, comm_latency: float) -> list[tuple[_Key, float]]:
    """The results (key, latency) that the action ``x`` waits for."""
    s, k, ns = x.stage, x.microbatch, topo.num_stages
    if x.kind is F and s > 0:
        return [(("F", s - 1, k), 0.0 if topo.is_local_edge(s - 1) else comm_latency)]
    if x.kind in (B, BI):
        need: list[tuple[_Key, float]] = [(("F", s, k), 0.0)]
        if s < ns - 1:
            need.append((("BWD", s + 1, k), 0.0 if topo.is_local_edge(s) else comm_latency))
        return need
    if x.kind is W:
        return [(("BWD", s, k), 0.0)]
    return []


def compute_times(
    program: Program, cost: Callable[[AnyAction], float], comm_latency: float = 0.0
) -> list[list[tuple[int, float, float]]]:
    """Start and end times of each rank's compute actions when sends never block.

    The forward of an :class:`OverlapAction` is done first (see :func:`produced_at`).

    Returns, per rank, ``(program index, start, end)`` for every compute action in program order.

    Raises:
        ValueError: if the actions' data dependencies form a cycle across ranks (the message names them).
    """
    topo = program.topology
    end: dict[_Key, float] = {}
    out: list[list[tuple[int, float, float]]] = [[] for _ in range(program.num_ranks)]
    compute_idx = [[i for i, a in enumerate(acts) if a.is_compute] for acts in program.actions]
    ptr = [0] * program.num_ranks
    free = [0.0] * program.num_ranks

    def deps(a: AnyAction) -> list[tuple[_Key, float]] | None:
        """(key, latency) pairs the action waits for; None if one has not been scheduled yet."""
        res: list[tuple[_Key, float]] = []
        subs = a.sub_actions()
        own = {_key(x.kind, x.stage, x.microbatch) for x in subs}
        for x in subs:
            need = _needs(x, topo, comm_latency)
            for key, lat in need:
                if key in own:
                    continue
                if key not in end:
                    return None
                res.append((key, lat))
        return res

    remaining = sum(len(c) for c in compute_idx)
    while remaining:
        progressed = False
        for r in range(program.num_ranks):
            while ptr[r] < len(compute_idx[r]):
                i = compute_idx[r][ptr[r]]
                a = program.actions[r][i]
                d = deps(a)
                if d is None:
                    break
                start = max([free[r]] + [end[k] + lat for k, lat in d])
                finish = start + cost(a)
                for x in a.sub_actions():
                    end[_key(x.kind, x.stage, x.microbatch)] = produced_at(a, x, start, finish, cost)
                out[r].append((i, start, finish))
                free[r] = finish
                ptr[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            waiting = [
                f"rank {r} at [{compute_idx[r][ptr[r]]}] {program.actions[r][compute_idx[r][ptr[r]]]}"
                for r in range(program.num_ranks)
                if ptr[r] < len(compute_idx[r])
            ]
            raise ValueError("cyclic data dependencies, no rank can proceed: " + "; ".join(waiting))
    return out


def produced_at(
    action: AnyAction, sub: Action, start: float, finish: float, cost: Callable[[AnyAction], float]
) -> float:
    """When `sub`, a part of `action` (run from `start` to `finish`), has its result: the forward of an
    :class:`OverlapAction` runs first, so its output is ready after ``cost(forward)``."""
    return start + cost(sub) if isinstance(action, OverlapAction) and sub is action.forward else finish


def unit_cost(a: AnyAction) -> float:
    """F=1, I=1, W=1, B=2; an overlapped pair costs the sum of its parts."""
    return float(sum(2 if x.kind is B else 1 for x in a.sub_actions()))
