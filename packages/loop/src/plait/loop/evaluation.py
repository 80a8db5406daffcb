"""Evaluation: the token-weighted validation loss of held-out batches, forward only through an executor."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from plait.loop.batch_plan import BatchPlan
from plait.loop.config import EvaluationConfig, TrainerConfig
from plait.loop.data import DistributedDataLoader
from plait.loop.loss import LOSS_KEY, StepLoss
from plait.loop.providers import DataProvider, Task
from plait.loop.topology import Topology
from plait.pipelining import OfflineExecutor, PipelineExecutor, PipelineState, Stack
from torch import nn

__all__ = ["Evaluator"]


class Evaluator:
    """Runs ``config.steps`` validation batches through a forward-only executor and reduces the loss.

    The executor is built on the training stages (:class:`~plait.pipelining.OfflineExecutor` with
    ``forward_only=True``, or a :class:`~plait.pipelining.PipelineExecutor` over
    :func:`~plait.pipelining.build_forward_program` of the training schedule), with ``loss`` as its
    ``loss_fn``. The loader keeps its own position (a ``Stateful``: checkpoint it with the run).

    Args:
        config: when and how much to evaluate.
        executor: the forward-only executor.
        loss: the executor's loss function (collects the loss sums and token counts).
        loader: this rank's validation loader.
        modules: the local model stages (put in eval mode while evaluating).
        device: where batches go.
        shard_batch: this rank's part of each validation batch (context parallelism:
            :meth:`plait.loop.Topology.shard_batch`); None keeps the batch whole.
    """

    def __init__(
        self,
        config: EvaluationConfig,
        executor: OfflineExecutor | PipelineExecutor,
        loss: StepLoss,
        loader: DistributedDataLoader,
        modules: Sequence[nn.Module],
        device: torch.device,
        shard_batch: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None,
    ) -> None:
        self.config = config
        self.executor = executor
        self.loss = loss
        self.loader = loader
        self.modules = list(modules)
        self.device = device
        self.shard_batch = shard_batch

    @classmethod
    def for_training(
        cls,
        config: TrainerConfig,
        data: DataProvider,
        plan: BatchPlan,
        topology: Topology,
        task: Task,
        modules: Sequence[nn.Module],
        device: torch.device,
        executor_for: Callable[[StepLoss], OfflineExecutor | PipelineExecutor],
    ) -> Evaluator:
        """The evaluator of a training run: ``data``'s validation loader for this rank, a forward-only
        executor on the training stages (``executor_for(loss)``), batches sharded like the training's.

        Raises:
            ValueError: the data provider gives no validation loader.
        """
        loader = data.build_validation_loader(config, plan, topology.dp_rank)
        if loader is None:
            raise ValueError(
                "evaluation.enabled is true but the data provider's build_validation_loader gave no loader"
            )
        loss = StepLoss(task, device)
        return cls(
            config.evaluation,
            executor_for(loss),
            loss,
            loader,
            modules,
            device,
            shard_batch=topology.shard_batch,
        )

    def due(self, step: int, last_step: int) -> bool:
        """Whether to evaluate after optimizer step ``step`` (every ``interval`` steps, and the last)."""
        interval = self.config.interval
        return step == last_step or (interval is not None and step % interval == 0)

    def evaluate(self) -> dict[str, float]:
        """``val_loss`` (token-weighted mean over all ranks' batches) and ``val_ppl = exp(val_loss)``."""
        self.loss.start(1)
        modes = [m.training for m in self.modules]
        for m in self.modules:
            m.eval()
        try:
            for _ in range(self.config.steps):
                state = PipelineState(self.executor.num_microbatches, specs={LOSS_KEY: Stack()})
                batch = next(self.loader)
                if self.shard_batch is not None:
                    batch = self.shard_batch(batch)
                for k, v in batch.items():
                    state.global_view[k] = v.to(self.device, non_blocking=True)
                self.executor.step({}, state)
        finally:
            for m, mode in zip(self.modules, modes):
                m.train(mode)
        reading = self.loss.stats.read()  # token-weighted over every rank's batches
        if reading.tokens == 0:
            raise ValueError("evaluation: the validation batches have no loss tokens")
        val_loss = reading.loss
        return {"val_loss": val_loss, "val_ppl": math.exp(val_loss) if val_loss < 700 else math.inf}
