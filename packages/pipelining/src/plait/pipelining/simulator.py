"""Cost-model simulator: step time, bubble fraction, peak live activations and a timeline of a program."""

from __future__ import annotations

import html
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from plait.pipelining.actions import Action, ActionKind, AnyAction
from plait.pipelining.program import Program
from plait.pipelining.timing import compute_times

__all__ = ["ActionCosts", "SimulationResult", "TimelineEntry", "simulate"]


@dataclass(frozen=True)
class ActionCosts:
    """Per-action costs (any time unit) and activation memory per (stage, microbatch).

    Attributes:
        forward: time of one stage forward on one microbatch.
        backward: full backward (``B``); defaults to ``backward_input + backward_weight`` when None.
        backward_input: ``I`` time.
        backward_weight: ``W`` time.
        comm: latency added to every cross-rank dependency.
        activation_memory: memory held from a forward until its backward frees it (``B``, or ``W`` when split).
        input_pass_frees: a split backward's ``I`` frees the activations instead of ``W`` (compiled layers:
            their ``I`` is the whole backward, see ``plait.pipelining.split_backward``).
    """

    forward: float = 1.0
    backward: float | None = None
    backward_input: float = 1.0
    backward_weight: float = 1.0
    comm: float = 0.0
    activation_memory: float = 1.0
    input_pass_frees: bool = False

    def of(self, action: AnyAction) -> float:
        total = 0.0
        for a in action.sub_actions():
            if a.kind is ActionKind.FORWARD:
                total += self.forward
            elif a.kind is ActionKind.BACKWARD:
                total += (
                    self.backward if self.backward is not None else self.backward_input + self.backward_weight
                )
            elif a.kind is ActionKind.BACKWARD_INPUT:
                total += self.backward_input
            elif a.kind is ActionKind.BACKWARD_WEIGHT:
                total += self.backward_weight
        return total


@dataclass(frozen=True)
class TimelineEntry:
    """One action of a simulated run: the rank that ran it, the action printed, its start and end."""

    rank: int
    action: str
    start: float
    end: float


@dataclass(frozen=True)
class SimulationResult:
    """Outcome of :func:`simulate`.

    Attributes:
        step_time: time from the first action start to the last action end.
        bubble_fraction: idle share of ``num_ranks * step_time``.
        busy: per-rank compute time.
        peak_activations: per-rank peak of live activation memory.
        timeline: every compute action with its start and end.
    """

    program_name: str
    num_ranks: int
    step_time: float
    bubble_fraction: float
    busy: tuple[float, ...]
    peak_activations: tuple[float, ...]
    timeline: tuple[TimelineEntry, ...]

    def render_ascii(self, width: int = 100) -> str:
        """Text timeline: one row per rank, each action drawn over its duration."""
        if self.step_time <= 0:
            return "(empty program)"
        label_w = max((len(e.action) for e in self.timeline), default=3) + 1
        shortest = min((e.end - e.start for e in self.timeline if e.end > e.start), default=1.0)
        scale = max(label_w / shortest, 1.0)
        scale = (
            min(scale, max(width, 20) * 4 / self.step_time) if self.step_time * scale > width * 4 else scale
        )
        cols = round(self.step_time * scale)
        rows = []
        for r in range(self.num_ranks):
            line = [" "] * cols
            for e in (e for e in self.timeline if e.rank == r):
                a, b = round(e.start * scale), round(e.end * scale)
                cell = ("[" + e.action).ljust(max(b - a, 1), ".")[: max(b - a, 1)]
                line[a : a + len(cell)] = list(cell)
            rows.append(f"rank {r:2d} |{''.join(line)}|")
        head = (
            f"{self.program_name}: step {self.step_time:g}, bubble {self.bubble_fraction:.3f}, "
            f"peak activations {list(self.peak_activations)}"
        )
        return "\n".join([head, *rows])

    def save(self, path: str | Path) -> Path:
        """Write the timeline as ``.png`` (matplotlib) or ``.html`` (inline SVG). Needs ``plait-pipelining[viz]``."""
        path = Path(path)
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError as err:  # pragma: no cover - depends on the environment
            raise ImportError(
                "SimulationResult.save needs matplotlib: pip install 'plait-pipelining[viz]'"
            ) from err
        colors = {"F": "#4c72b0", "B": "#dd8452", "I": "#c44e52", "W": "#55a868"}
        fig, ax = plt.subplots(figsize=(max(6.0, self.step_time * 0.35), 0.6 * self.num_ranks + 1))
        for e in self.timeline:
            kind = "F" if "|" in e.action else e.action.rstrip("0123456789").lstrip("0123456789")
            ax.barh(
                e.rank, e.end - e.start, left=e.start, color=colors.get(kind, "#8172b2"), edgecolor="black"
            )
            ax.text(
                (e.start + e.end) / 2, e.rank, e.action, ha="center", va="center", fontsize=6, color="white"
            )
        ax.set_yticks(range(self.num_ranks), [f"rank {r}" for r in range(self.num_ranks)])
        ax.invert_yaxis()
        ax.set_xlabel("time")
        ax.set_title(f"{self.program_name}: bubble {self.bubble_fraction:.3f}")
        fig.tight_layout()
        if path.suffix.lower() == ".html":
            import io

            buf = io.StringIO()
            fig.savefig(buf, format="svg")
            path.write_text(
                f"<!doctype html><html><head><title>{html.escape(self.program_name)}</title></head>"
                f"<body>{buf.getvalue()}</body></html>"
            )
        else:
            fig.savefig(path, dpi=120)
        plt.close(fig)
        return path


def simulate(
    program: Program,
    costs: ActionCosts | None = None,
    *,
    stage_costs: Mapping[int, ActionCosts] | None = None,
) -> SimulationResult:
    """Simulate `program` (lowered or not) under `costs`; sends never block, receives wait for the producer.

    Args:
        program: the program.
        costs: per-action costs of every stage, and the communication latency.
        stage_costs: costs of particular stages instead of `costs` (e.g. a first stage with the embedding, a
            last one with the head and the loss); their ``comm`` is not used.

    Raises:
        ValueError: if the program's dependencies form a cycle, or `stage_costs` names a stage that does not
            exist.
    """
    costs = costs or ActionCosts()
    per_stage = dict(stage_costs or {})
    unknown = sorted(set(per_stage) - set(range(program.topology.num_stages)))
    if unknown:
        raise ValueError(f"stage_costs: stages {unknown} do not exist ({program.topology.num_stages} stages)")

    def of(a: Action) -> ActionCosts:
        return per_stage.get(a.stage, costs)

    times = compute_times(program, lambda act: sum(of(a).of(a) for a in act.sub_actions()), costs.comm)
    timeline = tuple(
        TimelineEntry(r, str(program.actions[r][i]), st, en)
        for r, per in enumerate(times)
        for i, st, en in per
    )
    t0 = min((e.start for e in timeline), default=0.0)
    t1 = max((e.end for e in timeline), default=0.0)
    step = t1 - t0
    busy = tuple(sum(en - st for _, st, en in per) for per in times)
    bubble = 1.0 - sum(busy) / (program.num_ranks * step) if step > 0 else 0.0
    peaks = []
    for r, per in enumerate(times):
        split = {
            (a.stage, a.microbatch)
            for act in program.actions[r]
            for a in act.sub_actions()
            if a.kind is ActionKind.BACKWARD_WEIGHT
        }
        events: list[tuple[float, float]] = []  # (time, delta); frees sort before allocations at equal times
        for i, st, en in per:
            for a in program.actions[r][i].sub_actions():
                if a.kind is ActionKind.FORWARD:
                    events.append((st, of(a).activation_memory))
                elif a.kind is ActionKind.BACKWARD or (
                    a.kind
                    is (ActionKind.BACKWARD_INPUT if of(a).input_pass_frees else ActionKind.BACKWARD_WEIGHT)
                    and (a.stage, a.microbatch) in split
                ):
                    events.append((en, -of(a).activation_memory))
        live = peak = 0.0
        for _, d in sorted(events):
            live += d
            peak = max(peak, live)
        peaks.append(peak)
    return SimulationResult(program.name, program.num_ranks, step, bubble, busy, tuple(peaks), timeline)
