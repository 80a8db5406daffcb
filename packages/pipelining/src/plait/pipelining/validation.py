"""Validator for pipeline programs, including a dry run that proves a lowered program deadlock-free."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from plait.pipelining.actions import Action, ActionKind
from plait.pipelining.lowering import recvs_for
from plait.pipelining.program import Program

__all__ = ["ProgramError", "dry_run", "validate"]

F, B, BI, W = ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT
_Msg = tuple[str, int, int]  # ("F" | "B", sending stage, microbatch)


class ProgramError(ValueError):
    """A program is invalid. The message shows the offending rank's program with the bad action marked."""

    def __init__(
        self, message: str, program: Program | None = None, rank: int | None = None, index: int | None = None
    ):
        self.rank, self.index = rank, index
        text = message
        if program is not None and rank is not None:
            text += "\n" + program.format_rank(rank, mark=index)
        super().__init__(text)


def _message(a: Action) -> tuple[_Msg, int]:
    """The message a comm action carries and the stage on the other end."""
    if a.kind is ActionKind.SEND_F:
        return ("F", a.stage, a.microbatch), a.stage + 1
    if a.kind is ActionKind.RECV_F:
        return ("F", a.stage - 1, a.microbatch), a.stage - 1
    if a.kind is ActionKind.SEND_B:
        return ("B", a.stage, a.microbatch), a.stage - 1
    return ("B", a.stage + 1, a.microbatch), a.stage + 1  # RECV_B


_Key = tuple[ActionKind, int, int]  # (kind, stage, microbatch)
_Sent = dict[tuple[int, int], list[tuple[_Msg, int]]]  # (src rank, dst rank) -> [(message, group index)]


@dataclass
class _Facts:
    """What the rules of :func:`validate` know about a program, filled in by the rules that collect it.

    Attributes:
        program: the program.
        pos: (kind, stage, microbatch) -> (rank, index) of every action (from :func:`_each_action_placed_once`).
        sent / recvd: per rank pair, the messages sent / received in order, with their group's index
            (lowered programs, from :func:`_messages_between_ranks`).
        group_of: (side, message) -> (rank, index) of the group that posts it.
    """

    program: Program
    pos: dict[_Key, tuple[int, int]] = field(default_factory=dict)
    sent: _Sent = field(default_factory=lambda: defaultdict(list))
    recvd: _Sent = field(default_factory=lambda: defaultdict(list))
    group_of: dict[tuple[str, _Msg], tuple[int, int]] = field(default_factory=dict)

    def where(self, kind: ActionKind, s: int, k: int) -> tuple[int, int] | None:
        return self.pos.get((kind, s, k))


def validate(program: Program, *, check_deadlock: bool = True) -> None:
    """Check a program; raise :class:`ProgramError` on the first problem.

    Checks (``RULES``, then ``LOWERED_RULES`` for lowered programs): stage placement, each (stage,
    microbatch) forward exactly once, backward exactly once as ``B`` or as ``I`` then ``W``, backward after
    forward, local data dependencies in order, and for lowered programs: every remote input received before
    use, every send after its producer and matched by one receive on the right rank, sends and receives of
    each rank pair in the same order, groups that pair up across ranks, and a deadlock-free dry run.
    """
    facts = _Facts(program)
    for rule in RULES + (LOWERED_RULES if program.lowered else ()):
        rule(facts)
    if program.lowered and check_deadlock:
        dry_run(program)
        dry_run(program, lockstep=True)


def _each_action_placed_once(facts: _Facts) -> None:
    """Every action on an existing stage of its own rank and microbatch, once; comm only when lowered."""
    program = facts.program
    topo, m = program.topology, program.num_microbatches
    for r, acts in enumerate(program.actions):
        for i, act in enumerate(acts):
            for a in act.sub_actions():
                if a.stage >= topo.num_stages:
                    raise ProgramError(
                        f"{a}: stage {a.stage} does not exist ({topo.num_stages} stages)", program, r, i
                    )
                if topo.rank_of(a.stage) != r:
                    raise ProgramError(
                        f"{a}: stage {a.stage} belongs to rank {topo.rank_of(a.stage)}, not rank {r}",
                        program,
                        r,
                        i,
                    )
                if a.microbatch >= m:
                    raise ProgramError(
                        f"{a}: microbatch {a.microbatch} >= num_microbatches {m}", program, r, i
                    )
                key = (a.kind, a.stage, a.microbatch)
                if key in facts.pos:
                    raise ProgramError(
                        f"{a} appears twice (first at index {facts.pos[key][1]})", program, r, i
                    )
                if a.is_comm and not program.lowered:
                    raise ProgramError(
                        f"{a}: communication action in a program marked not lowered", program, r, i
                    )
                facts.pos[key] = (r, i)


def _each_microbatch_complete(facts: _Facts) -> None:
    """Each (stage, microbatch) has its forward, and one backward (``B``, or ``I`` and ``W``) if any."""
    program, where = facts.program, facts.where
    for s in range(program.topology.num_stages):
        r = program.topology.rank_of(s)
        for k in range(program.num_microbatches):
            if where(F, s, k) is None:
                raise ProgramError(f"forward {s}F{k} is missing", program, r, None)
            has_b, has_i, has_w = where(B, s, k), where(BI, s, k), where(W, s, k)
            if not program.has_backward:
                extra = has_b or has_i or has_w
                if extra:
                    raise ProgramError("backward action in a forward-only program", program, *extra)
                continue
            if has_b and (has_i or has_w):
                raise ProgramError(f"stage {s} microbatch {k} has both B and I/W", program, *has_b)
            if not has_b and not (has_i and has_w):
                which = "W" if has_i else "I" if has_w else "B (or I and W)"
                raise ProgramError(
                    f"backward {which} of stage {s} microbatch {k} is missing", program, r, None
                )


def _needs(facts: _Facts, a: Action) -> list[_Key]:
    """The actions ``a`` depends on, on its own rank."""
    topo, where = facts.program.topology, facts.where
    s, k = a.stage, a.microbatch
    if a.kind is F:
        if s == 0:
            return []
        return [(F, s - 1, k) if topo.is_local_edge(s - 1) else (ActionKind.RECV_F, s, k)]
    if a.kind in (B, BI):
        need: list[_Key] = [(F, s, k)]
        if s < topo.num_stages - 1:
            if topo.is_local_edge(s):
                need.append((B if where(B, s + 1, k) else BI, s + 1, k))
            else:
                need.append((ActionKind.RECV_B, s, k))
        return need
    if a.kind is W:
        return [(BI, s, k)]
    if a.kind is ActionKind.SEND_F:
        return [(F, s, k)]
    if a.kind is ActionKind.SEND_B:
        return [(B, s, k) if where(B, s, k) else (BI, s, k)]
    return []


def _dependencies_in_order(facts: _Facts) -> None:
    """Every action after the actions of its own rank that it depends on."""
    program = facts.program
    for r, acts in enumerate(program.actions):
        seen: set[_Key] = set()
        for i, act in enumerate(acts):
            for a in act.sub_actions():
                for n in _needs(facts, a):
                    if n[0].is_comm and not program.lowered:
                        continue
                    if n not in seen:
                        what = f"{n[1]}{n[0].value}{n[2]}"
                        raise ProgramError(f"{a} runs before {what}, which it depends on", program, r, i)
            seen.update((a.kind, a.stage, a.microbatch) for a in act.sub_actions())


def _messages_between_ranks(facts: _Facts) -> None:
    """Every comm action has a peer stage on another rank; collects the messages per rank pair."""
    program = facts.program
    topo = program.topology
    for r, acts in enumerate(program.actions):
        for i, act in enumerate(acts):
            if not act.is_comm:
                continue
            for a in act.sub_actions():
                msg, peer_stage = _message(a)
                facts.group_of[(_side(a), msg)] = (r, i)
                if not 0 <= peer_stage < topo.num_stages:
                    raise ProgramError(f"{a}: peer stage {peer_stage} does not exist", program, r, i)
                peer = topo.rank_of(peer_stage)
                if peer == r:
                    raise ProgramError(
                        f"{a}: stages {a.stage} and {peer_stage} are on the same rank", program, r, i
                    )
                if a.kind in (ActionKind.SEND_F, ActionKind.SEND_B):
                    facts.sent[(r, peer)].append((msg, i))
                else:
                    facts.recvd[(peer, r)].append((msg, i))


def _every_remote_edge_sent(facts: _Facts) -> None:
    """Every activation (and gradient) that crosses ranks is sent."""
    program, topo = facts.program, facts.program.topology
    for s in range(topo.num_stages - 1):
        if topo.is_local_edge(s):
            continue
        for k in range(program.num_microbatches):
            kinds = [("F", s, k)] + ([("B", s + 1, k)] if program.has_backward else [])
            for msg in kinds:
                src = topo.rank_of(s if msg[0] == "F" else s + 1)
                dst = topo.rank_of(s + 1 if msg[0] == "F" else s)
                if not any(x == msg for x, _ in facts.sent[(src, dst)]):
                    raise ProgramError(f"no send of {msg[0]} message {msg[1]}->{msg[2]}", program, src, None)


def _sends_match_receives(facts: _Facts) -> None:
    """Between each rank pair, the j-th send carries the j-th receive's message."""
    program = facts.program
    for pair in set(facts.sent) | set(facts.recvd):
        src, dst = pair
        ss, rr = facts.sent.get(pair, []), facts.recvd.get(pair, [])
        for j in range(max(len(ss), len(rr))):
            if j >= len(rr):
                raise ProgramError(
                    f"send {ss[j][0]} from rank {src} to rank {dst} has no matching receive",
                    program,
                    src,
                    ss[j][1],
                )
            if j >= len(ss):
                raise ProgramError(
                    f"receive {rr[j][0]} on rank {dst} from rank {src} has no matching send",
                    program,
                    dst,
                    rr[j][1],
                )
            if ss[j][0] != rr[j][0]:
                raise ProgramError(
                    f"order mismatch between rank {src} -> rank {dst}: rank {src}'s send #{j} is {ss[j][0]} "
                    f"but rank {dst}'s receive #{j} is {rr[j][0]}",
                    program,
                    dst,
                    rr[j][1],
                )


def _groups_pair_up(facts: _Facts) -> None:
    _check_groups_pair_up(facts.program, facts.group_of)


Rule = Callable[[_Facts], None]
# Every program; in this order (the later rules read what the earlier ones collected).
RULES: tuple[Rule, ...] = (_each_action_placed_once, _each_microbatch_complete, _dependencies_in_order)
# Lowered programs, after RULES.
LOWERED_RULES: tuple[Rule, ...] = (
    _messages_between_ranks,
    _every_remote_edge_sent,
    _sends_match_receives,
    _groups_pair_up,
)


def _check_groups_pair_up(program: Program, group_of: dict[tuple[str, _Msg], tuple[int, int]]) -> None:
    """A group's operations with one peer must have their partners in one group of that peer, and that group's
    operations with this rank their partners in this group. NCCL progresses a group's sends and receives
    concurrently only when both ends group them alike; otherwise a send may wait behind a receive."""
    for r, acts in enumerate(program.actions):
        for i, act in enumerate(acts):
            if not act.is_comm:
                continue
            peers: dict[int, set[int]] = defaultdict(set)  # peer rank -> its groups holding our partners
            for a in act.sub_actions():
                pr, pj = group_of[_partner(a)]
                peers[pr].add(pj)
            for pr, js in peers.items():
                theirs = [b for j in js for b in program.actions[pr][j].sub_actions()]
                if len(js) > 1 or any(
                    group_of[_partner(b)] != (r, i) for b in theirs if _peer_rank(program, b) == r
                ):
                    where_ = ", ".join(f"[{j}] {program.actions[pr][j]}" for j in sorted(js))
                    raise ProgramError(
                        f"group [{i}] {act} does not pair with one group of rank {pr} (its partners: {where_}); "
                        "both ends must post the sends and receives between them in groups that match",
                        program,
                        r,
                        i,
                    )


def _partner(a: Action) -> tuple[str, _Msg]:
    return ("R" if _side(a) == "S" else "S", _message(a)[0])


def _peer_rank(program: Program, a: Action) -> int:
    return program.topology.rank_of(_message(a)[1])


def dry_run(program: Program, *, lockstep: bool = False) -> None:
    """Execute a lowered program the way the executor does and raise :class:`ProgramError` on deadlock.

    Model (that of NCCL with one communication stream per rank, stricter than gloo): each rank's host walks its
    program in order; each communication entry (an action or a :class:`CommGroup`) is issued as one group onto
    the rank's communication queue without blocking the host; queued groups run one after another, and an
    operation completes once the peer has its matching operation in the group at the head of its own queue
    (or already completed). A compute action waits until the receives it consumes have completed. With
    `lockstep`, the host also waits for each group it issued to complete before going on.
    """
    if not program.lowered:
        raise ValueError("dry_run() needs a lowered program (see plait.pipelining.lower)")
    sim = _DryRun(program, lockstep)
    while True:
        progressed = any([sim.issue(r) for r in range(sim.n)])  # hosts: every rank, no short-circuit
        sim.match()
        progressed = sim.retire() or progressed
        if sim.finished():
            return
        if not progressed:
            raise sim.deadlock()


class _DryRun:
    """The state of :func:`dry_run`: each host's position and each rank's queue of communication groups."""

    def __init__(self, program: Program, lockstep: bool) -> None:
        self.program, self.lockstep = program, lockstep
        self.topo = program.topology
        self.n = self.topo.num_ranks
        self.cpu = [0] * self.n
        self.queues: list[list[tuple[int, list[Action]]]] = [[] for _ in range(self.n)]
        self.matched: set[_Msg] = set()

    def _head_msgs(self, r: int) -> set[tuple[str, _Msg]]:
        if not self.queues[r]:
            return set()
        return {(_side(a), _message(a)[0]) for a in self.queues[r][0][1]}

    def issue(self, r: int) -> bool:
        """Rank ``r``'s host issues groups and runs computes whose receives completed; True if it moved."""
        acts, progressed = self.program.actions[r], False
        while self.cpu[r] < len(acts) and not (self.lockstep and self.queues[r]):
            a = acts[self.cpu[r]]
            if a.is_comm:
                self.queues[r].append((self.cpu[r], list(a.sub_actions())))
            elif not all(_message(x)[0] in self.matched for x in recvs_for(self.topo, a)):
                break
            self.cpu[r] += 1
            progressed = True
        return progressed

    def match(self) -> None:
        """Match the operations at the heads of the queues with their peers' heads."""
        for r in range(self.n):
            if not self.queues[r]:
                continue
            for a in self.queues[r][0][1]:
                msg, peer_stage = _message(a)
                if msg not in self.matched and _partner(a) in self._head_msgs(self.topo.rank_of(peer_stage)):
                    self.matched.add(msg)

    def retire(self) -> bool:
        """Pop the head groups whose operations all completed; True if one was."""
        progressed = False
        for q in self.queues:
            while q and all(_message(a)[0] in self.matched for a in q[0][1]):
                q.pop(0)
                progressed = True
        return progressed

    def finished(self) -> bool:
        return all(self.cpu[r] >= len(self.program.actions[r]) and not self.queues[r] for r in range(self.n))

    def deadlock(self) -> ProgramError:
        parts, first = [], None
        for r in range(self.n):
            if self.queues[r]:
                idx = self.queues[r][0][0]
                parts.append(f"rank {r} communication blocked at [{idx}] {self.queues[r][0][1][0]}")
            elif self.cpu[r] < len(self.program.actions[r]):
                idx = self.cpu[r]
                parts.append(f"rank {r} waits at [{idx}] {self.program.actions[r][idx]}")
            else:
                continue
            first = first if first is not None else (r, idx)
        assert first is not None
        return ProgramError("deadlock in dry run: " + "; ".join(parts), self.program, *first)


def _side(a: Action) -> str:
    return "S" if a.kind in (ActionKind.SEND_F, ActionKind.SEND_B) else "R"
