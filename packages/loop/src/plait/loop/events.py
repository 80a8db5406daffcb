"""Typed training events and a tiny publish/subscribe bus.

Every phase of a step publishes a frozen dataclass before and after it runs. Subscribers are plain
callables registered per event type (or for :class:`Event` to see all of them), called in order of
subscription on every rank. This is how users hook into the loop without subclassing; checkpointing
subscribes to :class:`StepEnd`, the MoE bias update to :class:`AfterOptimizerStep`, the run summary to
:class:`TrainingStart`, :class:`MetricsLogged` and :class:`TrainingEnd`.

Each event carries the values of its phase as named, typed fields; none carries the trainer. A handler
that needs more (the model parts, to inspect the weights) closes over the trainer it subscribed through
(``trainer.subscribe(AfterOptimizerStep, lambda e: look_at(trainer.model_parts))``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import torch

if TYPE_CHECKING:
    from plait.loop.tracking.throughput import Interval

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
    """Base of all events; ``step`` counts the optimizer steps completed when it was published (skipped
    steps included), so during a step it is that step's 0-based index."""

    step: int


@dataclass(frozen=True)
class TrainingStart(Event):
    """Before the first step of :meth:`Trainer.fit`, after the resume (``step`` is the resumed step).

    Attributes:
        total_steps: the step count this ``fit`` trains to.
        tokens_seen: the run's positions trained on so far (a resumed run's count included).
    """

    total_steps: int
    tokens_seen: int


@dataclass(frozen=True)
class StepStart(Event):
    """Before the batch of step ``step`` is fetched."""


@dataclass(frozen=True)
class BeforeForwardBackward(Event):
    """Before the microbatches run; ``num_microbatches`` per rank, ``global_tokens`` (loss tokens) across dp."""

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
    waits for the device).

    ``grad_scale``: None when the gradients are clipped in place; else the clipping factor (a 0-d
    device tensor) that the optimizers' step applies as it reads the gradients (every optimizer a
    :class:`~plait.kernels.StochasticAdamW`), the gradients themselves still unclipped."""

    grad_norm: torch.Tensor
    grad_scale: torch.Tensor | None = None


@dataclass(frozen=True)
class AfterOptimizerStep(Event):
    """After ``optimizer.step()`` and the LR step, gradients zeroed: the place for post-step
    parameter updates such as the MoE router-bias update. ``lr`` is the learning rate the step used."""

    lr: float


@dataclass(frozen=True)
class StepSkipped(Event):
    """The step's loss was not finite and the policy is ``skip``; ``skipped_total`` counts them."""

    loss: float
    skipped_total: int


@dataclass(frozen=True)
class StepEnd(Event):
    """Step done; ``step`` is now the number of completed steps.

    Attributes:
        metrics: this step's ``loss`` and ``grad_norm`` (global values, read from the device when first
            looked at).
        lr: the learning rate the step used (the first parameter group's).
        loss_tokens: the step's loss tokens over all data-parallel ranks (its loss is the mean over them).
        tokens_seen: the run's positions trained on, this step's included.
        skipped: whether the step was skipped (non-finite values under the ``skip`` policy).
        seconds: the step's wall time in the loop, from fetching its batch to this event.
    """

    metrics: Mapping[str, float]
    lr: float
    loss_tokens: int
    tokens_seen: int
    skipped: bool
    seconds: float


@dataclass(frozen=True)
class MetricsLogged(Event):
    """Synchronised metrics were sent to the trackers.

    Attributes:
        metrics: what was logged (training metrics, and ``val_loss``/``val_ppl`` after an evaluation).
        interval: the training throughput interval that ended here (its tokens, seconds, whether
            torch.compile compiled during it); None when only an evaluation was logged.
    """

    metrics: dict[str, float]
    interval: Interval | None = None


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
