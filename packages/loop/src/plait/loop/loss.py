"""The step's loss: the task's loss divided by the step's global token count, with its statistics."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from plait.loop.providers import Task
from plait.pipelining import MicrobatchView

__all__ = [
    "LOSS_KEY",
    "LossStats",
    "PackedStats",
    "PendingStep",
    "StepLoss",
    "StepMetrics",
    "StepReading",
    "batch_of",
]

LOSS_KEY = "loss"  # where the executor stores each microbatch's loss in the step's PipelineState


def batch_of(mb: MicrobatchView) -> dict[str, torch.Tensor]:
    """The batch tensors of one microbatch of the step's state (everything but the executor's loss)."""
    return {k: mb[k] for k in mb if k != LOSS_KEY}


@dataclass(frozen=True)
class LossStats:
    """What the microbatch losses of one step on this rank add up to (float64 device tensors).

    Attributes:
        loss_sum: sum of the reported loss over the loss tokens.
        num_tokens: loss tokens.
        metrics: the task's extra metrics as ``name -> (sum of value x weight, sum of weights)``.
    """

    loss_sum: torch.Tensor
    num_tokens: torch.Tensor
    metrics: Mapping[str, tuple[torch.Tensor, torch.Tensor]]

    def read(self, grad_norm: torch.Tensor | None = None) -> StepReading:
        """The step's one host read: the loss sums all-reduced over the world, with ``grad_norm``
        (NaN when None)."""
        return self.pack(grad_norm).read()

    def pack(self, grad_norm: torch.Tensor | None = None) -> PackedStats:
        """The loss sums all-reduced over the world (a collective, every rank calls it), with
        ``grad_norm``, in one device tensor: no host synchronisation until :meth:`PackedStats.read`."""
        local = torch.stack([self.loss_sum, self.num_tokens])
        world = local.clone()
        if dist.is_initialized():
            dist.all_reduce(
                world
            )  # every rank holding a last stage adds its sums (replicas scale both alike)
        names = sorted(self.metrics)
        extra = [torch.stack(self.metrics[n]) for n in names]
        norm = (grad_norm if grad_norm is not None else torch.full((), math.nan)).detach()
        norm = norm.to(local.device, torch.float64).reshape(1)
        return PackedStats(torch.cat([world, local, norm, *extra]), tuple(names))


@dataclass(frozen=True)
class StepReading:
    """A step's statistics on the host (see :meth:`LossStats.read`).

    Attributes:
        loss: the token-weighted loss over all ranks (NaN without loss tokens).
        tokens: the loss tokens over all ranks.
        grad_norm: the global gradient norm.
        local_loss_sum: this rank's loss sum.
        local_tokens: this rank's loss tokens.
        metrics: this rank's task metrics as ``name -> (weighted mean, weight)``.
    """

    loss: float
    tokens: float
    grad_norm: float
    local_loss_sum: float
    local_tokens: float
    metrics: dict[str, tuple[float, float]]


class PackedStats:
    """A step's statistics on the device (:meth:`LossStats.pack`); :meth:`read` copies them to the host
    once (a device synchronisation) and keeps the result."""

    def __init__(self, values: torch.Tensor, metric_names: tuple[str, ...]) -> None:
        self.values, self.metric_names = values, metric_names
        self._reading: StepReading | None = None

    def read(self) -> StepReading:
        """The statistics on the host (the first call waits for the step's device work)."""
        if self._reading is None:
            g_sum, g_tokens, l_sum, l_tokens, norm_value, *rest = self.values.tolist()
            pairs = {n: (rest[2 * i], rest[2 * i + 1]) for i, n in enumerate(self.metric_names)}
            self._reading = StepReading(
                g_sum / g_tokens if g_tokens else math.nan,
                g_tokens,
                norm_value,
                l_sum,
                l_tokens,
                {n: (v / w if w else 0.0, w) for n, (v, w) in pairs.items()},
            )
        return self._reading


class StepLoss:
    """The executor's ``loss_fn``: ``task.loss(...).objective / global_tokens`` for each microbatch.

    It adds up the losses' statistics as device tensors (no host synchronisation inside the step);
    :meth:`start` begins a step, :attr:`stats` is what the step's microbatches added up to. The
    microbatch's batch tensors are read from the step's state (see :func:`batch_of`).

    Args:
        task: gives the loss of the last stage's outputs.
        device: where the statistics accumulate.
    """

    def __init__(self, task: Task, device: torch.device) -> None:
        self.task = task
        self.device = device
        self.global_tokens = 1
        self.stats = self._zero()

    def _zero(self) -> LossStats:
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        return LossStats(zero, zero.clone(), {})

    def start(self, global_tokens: int) -> None:
        """Begin a step with ``global_tokens`` loss tokens over all dp ranks."""
        self.global_tokens = global_tokens
        self.stats = self._zero()

    def __call__(self, outputs: dict[str, torch.Tensor], mb: MicrobatchView) -> torch.Tensor:
        lo = self.task.loss(outputs, batch_of(mb))
        st = self.stats
        st.loss_sum.add_(lo.loss_sum.detach().double())
        st.num_tokens.add_(torch.as_tensor(lo.num_tokens, device=self.device).double())
        metrics = dict(st.metrics)
        for name, (value, weight) in lo.metrics.items():
            w = torch.as_tensor(weight, device=self.device).double()
            v = torch.as_tensor(value, device=self.device).detach().double() * w
            total, weights = metrics.get(name, (0.0, 0.0))
            metrics[name] = (v + total, w + weights)  # type: ignore[assignment]
        self.stats = LossStats(st.loss_sum, st.num_tokens, metrics)
        return lo.objective / self.global_tokens


class PendingStep:
    """A launched training step: its statistics on the device until read (the trainer reads them once per
    logging interval)."""

    __slots__ = ("global_tokens", "lr", "packed", "skipped", "step")

    def __init__(self, step: int, packed: PackedStats, lr: float, global_tokens: int) -> None:
        self.step, self.packed, self.lr, self.global_tokens = step, packed, lr, global_tokens
        self.skipped = False


class StepMetrics(Mapping[str, float]):
    """A step's ``loss`` and ``grad_norm`` for ``StepEnd``, read from the device when first looked at."""

    def __init__(self, pending: PendingStep) -> None:
        self._pending = pending

    def _values(self) -> dict[str, float]:
        r = self._pending.packed.read()
        return {"loss": r.loss, "grad_norm": r.grad_norm}

    def __getitem__(self, key: str) -> float:
        return self._values()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(("loss", "grad_norm"))

    def __len__(self) -> int:
        return 2
