"""A pipeline program: one ordered action list per rank, plus its topology and microbatch count."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from plait.pipelining.actions import ActionKind, AnyAction, parse_action
from plait.pipelining.topology import StageTopology

__all__ = ["Program", "parse_program"]


@dataclass(frozen=True)
class Program:
    """Per-rank action lists. ``lowered`` tells whether communication actions are included.

    Attributes:
        topology: stage placement.
        num_microbatches: microbatches per step.
        actions: ``actions[r]`` is rank r's ordered program.
        lowered: True once :func:`plait.pipelining.lower` inserted sends/receives.
        name: schedule name, for messages.
    """

    topology: StageTopology
    num_microbatches: int
    actions: tuple[tuple[AnyAction, ...], ...]
    lowered: bool = False
    name: str = "custom"
    has_backward: bool = field(default=True)

    def __post_init__(self) -> None:
        if len(self.actions) != self.topology.num_ranks:
            raise ValueError(
                f"Program has {len(self.actions)} rank programs but the topology has {self.topology.num_ranks} ranks"
            )

    @staticmethod
    def from_lists(
        topology: StageTopology,
        num_microbatches: int,
        actions: Sequence[Sequence[AnyAction]],
        *,
        lowered: bool = False,
        name: str = "custom",
        has_backward: bool = True,
    ) -> Program:
        return Program(
            topology, num_microbatches, tuple(tuple(a) for a in actions), lowered, name, has_backward
        )

    @property
    def num_ranks(self) -> int:
        return self.topology.num_ranks

    @property
    def splits_backward(self) -> bool:
        """Some rank runs a backward as two passes (input gradients, then weight gradients) over one graph."""
        return any(a.kind is ActionKind.BACKWARD_WEIGHT for acts in self.actions for act in acts
                   for a in act.sub_actions())  # fmt: skip

    def format(self) -> str:
        """Text dump: a header line, then ``rank R: a1 a2 ...`` per rank (parse back with :func:`parse_program`)."""
        stages = ",".join(str(r) for r in self.topology.stage_to_rank)
        head = (
            f"# program {self.name} microbatches={self.num_microbatches} stage_to_rank={stages} "
            f"style={self.topology.style} lowered={int(self.lowered)} backward={int(self.has_backward)}"
        )
        lines = [head] + [
            f"rank {r}: " + " ".join(str(a) for a in acts) for r, acts in enumerate(self.actions)
        ]
        return "\n".join(lines)

    def format_rank(self, rank: int, mark: int | None = None) -> str:
        """One rank's program, one action per line, with ``>>>`` before index `mark`."""
        lines = [f"rank {rank} program ({self.name}):"]
        for i, a in enumerate(self.actions[rank]):
            prefix = ">>> " if i == mark else "    "
            lines.append(f"{prefix}[{i:3d}] {a}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()


def parse_program(text: str) -> Program:
    """Inverse of :meth:`Program.format`."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    if not lines or not lines[0].startswith("# program"):
        raise ValueError("program text must start with a '# program ...' header line")
    fields = dict(tok.split("=", 1) for tok in lines[0].split()[3:])
    name = lines[0].split()[2]
    try:
        stage_to_rank = tuple(int(x) for x in fields["stage_to_rank"].split(","))
        style = fields.get("style", "loop")
        topo = StageTopology(max(stage_to_rank) + 1, stage_to_rank, style)  # type: ignore[arg-type]
        m = int(fields["microbatches"])
    except KeyError as e:
        raise ValueError(f"program header is missing field {e}") from e
    actions: list[list[AnyAction]] = [[] for _ in range(topo.num_ranks)]
    for ln in lines[1:]:
        head, _, body = ln.partition(":")
        if not head.startswith("rank "):
            raise ValueError(f"expected 'rank R: ...', got {ln!r}")
        actions[int(head[5:])] = [parse_action(t) for t in body.split()]
    return Program.from_lists(
        topo,
        m,
        actions,
        lowered=fields.get("lowered", "0") == "1",
        name=name,
        has_backward=fields.get("backward", "1") == "1",
    )
