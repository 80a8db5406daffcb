"""Stateful metrics (mean, sum, min, max, composition) synchronised over a process group.

A :class:`Metric` accumulates local values; :meth:`MetricCollection.compute` reduces every metric
across a process group (or a mesh dimension's group) in one collective per reduction kind, so a step
with many metrics costs at most three small all-reduces. Everything is stateful for checkpoints.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["Derived", "Max", "Mean", "Metric", "MetricCollection", "Min", "Sum"]


class Metric:
    """Base: a fixed number of float64 accumulators combined by one reduction op."""

    op: str = "sum"  # "sum" | "min" | "max"
    _init: tuple[float, ...] = (0.0,)

    def __init__(self) -> None:
        self._state = list(self._init)

    def update(self, value: float | torch.Tensor, weight: float | torch.Tensor = 1.0) -> None:
        """Add one observation."""
        raise NotImplementedError

    def reset(self) -> None:
        """Back to the empty state."""
        self._state = list(self._init)

    def value_of(self, state: list[float]) -> float:
        """The value of accumulators ``state`` (this metric's own, or reduced over ranks)."""
        return state[0]

    def local(self) -> float:
        """The value over this rank's observations only."""
        return self.value_of(self._state)

    def state_dict(self) -> dict[str, Any]:
        """The accumulators (plain floats)."""
        return {"state": list(self._state)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the accumulators."""
        self._state = [float(x) for x in state["state"]]


def _f(x: float | torch.Tensor) -> float:
    return float(x.detach().float().item()) if isinstance(x, torch.Tensor) else float(x)


class Sum(Metric):
    """Sum of the values (times their weights)."""

    def update(self, value: float | torch.Tensor, weight: float | torch.Tensor = 1.0) -> None:
        self._state[0] += _f(value) * _f(weight)


class Mean(Metric):
    """Weighted mean; ``weight`` is e.g. a token count so the mean is token-weighted."""

    _init = (0.0, 0.0)

    def update(self, value: float | torch.Tensor, weight: float | torch.Tensor = 1.0) -> None:
        w = _f(weight)
        self._state[0] += _f(value) * w
        self._state[1] += w

    def value_of(self, state: list[float]) -> float:
        return state[0] / state[1] if state[1] else math.nan


class Min(Metric):
    """Minimum of the values."""

    op = "min"
    _init = (math.inf,)

    def update(self, value: float | torch.Tensor, weight: float | torch.Tensor = 1.0) -> None:
        self._state[0] = min(self._state[0], _f(value))


class Max(Metric):
    """Maximum of the values."""

    op = "max"
    _init = (-math.inf,)

    def update(self, value: float | torch.Tensor, weight: float | torch.Tensor = 1.0) -> None:
        self._state[0] = max(self._state[0], _f(value))


class Derived:
    """A metric computed from other metrics' reduced values, e.g. perplexity = exp(loss)."""

    def __init__(self, fn: Callable[..., float], *inputs: str) -> None:
        self.fn = fn
        self.inputs = inputs


class MetricCollection:
    """Named metrics reduced together over a process group.

    Args:
        metrics: name -> :class:`Metric` or :class:`Derived` (derived ones read the reduced values
            of the names they list).
        group: the process group to reduce over (None: the default group when initialised); pass
            e.g. ``mesh["dp"].get_group()`` to reduce over one mesh dimension.
    """

    def __init__(
        self, metrics: Mapping[str, Metric | Derived] | None = None, group: dist.ProcessGroup | None = None
    ) -> None:
        self.metrics: dict[str, Metric | Derived] = dict(metrics or {})
        self.group = group

    def add(self, name: str, metric: Metric | Derived) -> Metric | Derived:
        """Register ``metric`` under ``name`` (kept if the name exists and has the same type)."""
        old = self.metrics.get(name)
        if old is not None and type(old) is type(metric):
            return old
        self.metrics[name] = metric
        return metric

    def __getitem__(self, name: str) -> Metric | Derived:
        return self.metrics[name]

    def update(self, name: str, value: float | torch.Tensor, weight: float | torch.Tensor = 1.0) -> None:
        """Update metric ``name``, creating a :class:`Mean` on first use."""
        m = self.metrics.get(name)
        if m is None:
            m = self.metrics[name] = Mean()
        if isinstance(m, Derived):
            raise TypeError(f"metric {name!r} is derived; it cannot be updated")
        m.update(value, weight)

    def reset(self) -> None:
        """Reset every accumulating metric."""
        for m in self.metrics.values():
            if isinstance(m, Metric):
                m.reset()

    def compute(self, sync: bool = True) -> dict[str, float]:
        """Reduced values of all metrics (synchronised across the group when ``sync`` and distributed).

        All ranks of the group must call it with the same metric names.
        """
        if sync and dist.is_available() and dist.is_initialized():
            self._union_names()
        states = {n: m.state_dict()["state"] for n, m in self.metrics.items() if isinstance(m, Metric)}
        if sync and dist.is_available() and dist.is_initialized():
            states = self._reduce(states)
        out: dict[str, float] = {}
        for n, m in self.metrics.items():
            if isinstance(m, Metric):
                out[n] = m.value_of(states[n])
        for n, m in self.metrics.items():
            if isinstance(m, Derived):
                out[n] = float(m.fn(*(out[i] for i in m.inputs)))
        return out

    def _union_names(self) -> None:
        # Ranks may have seen different metric names (e.g. only the last pipeline stage computes the
        # loss's extra terms); every rank must reduce the same set, so add the missing ones empty.
        mine = sorted((n, type(m).__name__) for n, m in self.metrics.items() if isinstance(m, Metric))
        gathered: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(gathered, mine, group=self.group)
        kinds = {"Mean": Mean, "Sum": Sum, "Min": Min, "Max": Max}
        for names in gathered:
            for n, kind in names:
                if n not in self.metrics:
                    self.metrics[n] = kinds.get(kind, Mean)()

    def _reduce(self, states: dict[str, list[float]]) -> dict[str, list[float]]:
        ops = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}
        backend = dist.get_backend(self.group)
        device = (
            torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        )
        for op_name, op in ops.items():
            names = sorted(n for n in states if self.metrics[n].op == op_name)  # type: ignore[union-attr]
            if not names:
                continue
            flat = torch.tensor([v for n in names for v in states[n]], dtype=torch.float64, device=device)
            dist.all_reduce(flat, op=op, group=self.group)
            values = flat.tolist()
            i = 0
            for n in names:
                k = len(states[n])
                states[n] = values[i : i + k]
                i += k
        return states

    def state_dict(self) -> dict[str, Any]:
        """Local accumulators of every metric, by name."""
        return {n: m.state_dict() for n, m in self.metrics.items() if isinstance(m, Metric)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore accumulators (metrics missing here are created as :class:`Mean`/``Sum``... by shape)."""
        for n, s in state.items():
            m = self.metrics.get(n)
            if m is None:
                m = self.metrics[n] = Mean() if len(s["state"]) == 2 else Sum()
            if isinstance(m, Metric):
                m.load_state_dict(s)
