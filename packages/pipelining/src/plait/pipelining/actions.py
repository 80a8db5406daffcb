"""Action IR: the records a pipeline program is made of, with a compact text form."""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

__all__ = ["Action", "ActionKind", "AnyAction", "CommGroup", "OverlapAction", "parse_action"]


class ActionKind(enum.Enum):
    """What an action does. Values are the compact spellings used in text dumps."""

    FORWARD = "F"
    BACKWARD = "B"  # full backward: input and weight gradients together
    BACKWARD_INPUT = "I"  # gradients w.r.t. the stage inputs only
    BACKWARD_WEIGHT = "W"  # gradients w.r.t. the stage parameters (after I)
    SEND_F = "SEND_F"  # send the activations stage `stage` produced for `microbatch` to stage+1
    RECV_F = "RECV_F"  # receive the activations stage `stage` consumes (from stage-1)
    SEND_B = "SEND_B"  # send the input gradients stage `stage` produced to stage-1
    RECV_B = "RECV_B"  # receive the output gradients stage `stage` consumes (from stage+1)

    @property
    def is_compute(self) -> bool:
        return self in _COMPUTE

    @property
    def is_comm(self) -> bool:
        return not self.is_compute


_COMPUTE = frozenset(
    {ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT}
)
_ACTION_RE = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B|I|W)(\d+)$")


@dataclass(frozen=True, slots=True)
class Action:
    """One step of a rank's program: `kind` applied to `microbatch` of `stage` (global stage index).

    Prints as ``"{stage}{kind}{microbatch}"``, e.g. ``"0F3"``, ``"1I2"``, ``"2SEND_F0"``.
    """

    stage: int
    kind: ActionKind
    microbatch: int

    def __post_init__(self) -> None:
        if self.stage < 0 or self.microbatch < 0:
            raise ValueError(f"Action stage and microbatch must be >= 0, got {self.stage}, {self.microbatch}")

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.microbatch}"

    def __repr__(self) -> str:
        return f"Action({self})"

    @property
    def is_compute(self) -> bool:
        return self.kind.is_compute

    @property
    def is_comm(self) -> bool:
        return self.kind.is_comm

    def sub_actions(self) -> tuple[Action, ...]:
        return (self,)


@dataclass(frozen=True, slots=True)
class OverlapAction:
    """A forward and a backward run together so that one's communication hides behind the other's compute.

    Used by DualPipeV's steady state. Prints as ``"0F3|5B1"`` (forward first).
    """

    forward: Action
    backward: Action

    def __post_init__(self) -> None:
        if self.forward.kind is not ActionKind.FORWARD:
            raise ValueError(f"OverlapAction.forward must be a forward action, got {self.forward}")
        if self.backward.kind not in (ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT):
            raise ValueError(f"OverlapAction.backward must be a B or I action, got {self.backward}")

    def __str__(self) -> str:
        return f"{self.forward}|{self.backward}"

    def __repr__(self) -> str:
        return f"OverlapAction({self})"

    @property
    def is_compute(self) -> bool:
        return True

    @property
    def is_comm(self) -> bool:
        return False

    def sub_actions(self) -> tuple[Action, ...]:
        return (self.forward, self.backward)


@dataclass(frozen=True, slots=True)
class CommGroup:
    """Sends and receives posted together as one group (one ``batch_isend_irecv``) in a lowered program.

    NCCL progresses the operations of a group concurrently only when each peer posts its matching operations
    in one group as well; the validator checks that groups pair up across ranks. Prints as
    ``"0SEND_F1+0RECV_B0"``. A group of one operation is written as that :class:`Action`.
    """

    ops: tuple[Action, ...]

    def __post_init__(self) -> None:
        if len(self.ops) < 2 or not all(isinstance(a, Action) and a.is_comm for a in self.ops):
            raise ValueError(f"CommGroup needs two or more send/receive actions, got {self.ops}")

    def __str__(self) -> str:
        return "+".join(str(a) for a in self.ops)

    def __repr__(self) -> str:
        return f"CommGroup({self})"

    @property
    def is_compute(self) -> bool:
        return False

    @property
    def is_comm(self) -> bool:
        return True

    def sub_actions(self) -> tuple[Action, ...]:
        return self.ops


AnyAction = Action | OverlapAction | CommGroup


def parse_action(text: str) -> AnyAction:
    """Parse the compact form written by ``str(action)``.

    Raises:
        ValueError: if `text` is not a valid action string.
    """
    text = text.strip()
    if "+" in text:
        ops = [parse_action(t) for t in text.split("+")]
        if not all(isinstance(a, Action) and a.is_comm for a in ops):
            raise ValueError(f"Cannot parse action {text!r}: a '+' group holds send/receive actions only")
        return CommGroup(tuple(ops))  # type: ignore[arg-type]
    if "|" in text:
        left, _, right = text.partition("|")
        fwd, bwd = parse_action(left), parse_action(right)
        if not isinstance(fwd, Action) or not isinstance(bwd, Action):
            raise ValueError(f"Cannot parse action {text!r}: nested overlaps are not allowed")
        return OverlapAction(fwd, bwd)
    m = _ACTION_RE.match(text)
    if m is None:
        raise ValueError(
            f"Cannot parse action {text!r}: expected '<stage><kind><microbatch>' with kind in "
            "F, B, I, W, SEND_F, RECV_F, SEND_B, RECV_B (e.g. '0F3'), 'fwd|bwd' for an overlap, or 'a+b' for a communication group"
        )
    return Action(int(m.group(1)), ActionKind(m.group(2)), int(m.group(3)))
