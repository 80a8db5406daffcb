"""Typed training events and a tiny publish/subscribe bus.

Every phase of a step publishes a frozen dataclass before and after it runs. Subscribers are plain
callables registered per event type (or for :class:`Event` to see all of them), called in order of
subscription on every rank. This is how users hook into the loop without subclassing; checkpointing
subscribes to :class:`StepEnd`, the MoE bias update to :class:`AfterOptimizerStep`.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import torch

if TYPE_CHECKING:
    from plait.loop.trainer import Trainer

__all__ = [
    "AfterBackward",
    "AfterForwardBackward",
    "AfterOptimizerStep",
    "BeforeForwardBackward",
    "BeforeOptimizerStep",
    "Event",
    "EventBus",
    "MetricsLogged",
    "StepEnd",
    "StepSkipped",
    "StepStart",
    "TrainingEnd",
    "TrainingStart",
]


@dataclass(frozen=True)
class Event:
    """Base of all events. ``trainer`` is the :class:`~plait.loop.Trainer` that published it."""

    trainer: Trainer = field(repr=False)
    step: int


@dataclass(frozen=True)
class TrainingStart(Event):
    """Before the first step of :meth:`Trainer.fit` (after a resume, ``step`` is the resumed step)."""


@dataclass(frozen=True)
class StepStart(Event):
    """Before the batch of step ``step`` (0-based count of completed steps) is fetched."""


@dataclass(frozen=True)
class BeforeForwardBackward(Event):
    """Before the microbatches run; ``num_microbatches`` per rank, ``global_tokens`` across dp."""

    num_microbatches: int
    global_tokens: int


@dataclass(frozen=True)
class AfterBackward(Event):
    """After the backward of ``microbatch`` on this rank's first stage (its weight gradients are complete).

    Under pipeline parallelism the schedule decides the order of the microbatches."""

    microbatch: int


@dataclass(frozen=True)
class AfterForwardBackward(Event):
    """All microbatches done, gradients synchronised, before clipping."""


@dataclass(frozen=True)
class BeforeOptimizerStep(Event):
    """After clipping; ``grad_norm`` is the global pre-clip norm, a 0-d device tensor (``float()`` of it
    waits for the device)."""

    grad_norm: torch.Tensor


@dataclass(frozen=True)
class AfterOptimizerStep(Event):
    """After ``optimizer.step()`` and the LR step, gradients zeroed: the place for post-step
    parameter updates such as the MoE router-bias update."""


@dataclass(frozen=True)
class StepSkipped(Event):
    """The step's loss was not finite and the policy is ``skip``; ``skipped_total`` counts them."""

    loss: float
    skipped_total: int


@dataclass(frozen=True)
class StepEnd(Event):
    """Step done; ``step`` is now the number of completed steps; ``metrics`` are this step's ``loss`` and
    ``grad_norm`` (global values, read from the device when first looked at)."""

    metrics: Mapping[str, float]


@dataclass(frozen=True)
class MetricsLogged(Event):
    """Synchronised metrics were sent to the trackers."""

    metrics: dict[str, float]


@dataclass(frozen=True)
class TrainingEnd(Event):
    """After the last step (or a stop request); trackers are still open."""

    stopped_early: bool


E = TypeVar("E", bound=Event)


class EventBus:
    """Publish/subscribe by event type; subscribing to :class:`Event` receives every event."""

    def __init__(self) -> None:
        self._subs: dict[type[Event], list[Callable[[Any], None]]] = defaultdict(list)

    def subscribe(self, event_type: type[E], fn: Callable[[E], None]) -> Callable[[], None]:
        """Call ``fn(event)`` for each published event of ``event_type`` (or a subclass).

        Returns:
            A function that unsubscribes ``fn``.
        """
        if not (isinstance(event_type, type) and issubclass(event_type, Event)):
            raise TypeError(f"subscribe: event_type must be an Event subclass, got {event_type!r}")
        self._subs[event_type].append(fn)
        return lambda: self._subs[event_type].remove(fn)

    def publish(self, event: Event) -> None:
        """Deliver ``event`` to the subscribers of its type and of its base classes."""
        for cls in type(event).__mro__:
            for fn in list(self._subs.get(cls, ())):
                fn(event)
