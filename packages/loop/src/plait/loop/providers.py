"""Provider protocols (how the loop talks to a model, data, task, optimizer and LR schedule) and
ready-made providers for the common cases.

The loop never imports a model package: whatever satisfies :class:`ModelProvider` trains.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from plait.dist_core import init_as_one_process
from plait.model_state import materialize
from torch import nn

if TYPE_CHECKING:
    from plait.dist_core import DistributedContext
    from plait.loop.batch_plan import BatchPlan
    from plait.loop.config import TrainerConfig
    from plait.loop.data import DistributedDataLoader

__all__ = [
    "CausalLMTask",
    "DataProvider",
    "DatasetProvider",
    "LRScheduler",
    "LRSchedulerProvider",
    "LossOutput",
    "ModelProvider",
    "ModuleProvider",
    "OnePassLoss",
    "OptimizerProvider",
    "Task",
    "default_init_weights",
]

Batch = dict[str, torch.Tensor]


@runtime_checkable
class ModelProvider(Protocol):
    """Builds and prepares the model, one pipeline stage at a time.

    The loop calls, per local stage: :meth:`build_stage` (on the meta device), :meth:`parallelize`,
    :meth:`materialize` (allocate on the device + initialise), then :meth:`load_initial_weights`
    with all local stages. Stage forwards take keyword tensors and return ``dict[str, Tensor]``.
    After every optimizer step that ran, the :class:`~plait.loop.Trainer` calls
    :meth:`after_optimizer_step` with the local stages and its distributed context.
    """

    def build_stage(self, stage_index: int, num_stages: int) -> nn.Module:
        """Stage ``stage_index`` of ``num_stages`` (the whole model for 1), built on ``torch.device("meta")``."""
        ...

    def parallelize(
        self, module: nn.Module, ctx: DistributedContext | None, config: TrainerConfig
    ) -> nn.Module:
        """Apply TP/EP/FSDP/compile to a stage with the distributed context ``ctx``; return the module."""
        ...

    def materialize(self, module: nn.Module, device: torch.device) -> None:
        """Allocate the (meta) stage on ``device`` and initialise its weights."""
        ...

    def load_initial_weights(self, modules: Sequence[nn.Module]) -> None:
        """Load pretrained/seed weights into the local stages (no-op for training from scratch)."""
        ...

    def flops_per_token(self, seq_len: int) -> float | None:
        """Training FLOPs (forward + backward) per token of the whole model, for MFU (None: unknown)."""
        ...

    def after_optimizer_step(self, modules: Sequence[nn.Module], ctx: DistributedContext | None) -> None:
        """The model's own update after an optimizer step (e.g. the MoE routers' auxiliary-loss-free
        bias update); ``modules`` are the local stages. Most models do nothing here."""
        ...


@runtime_checkable
class OnePassLoss(Protocol):
    """A module whose loss may compute its gradients in the forward (e.g. plait.models' ``LMHead``).

    One pass over the classifier instead of two, but the gradients are held from the forward to the
    backward: once per forward in flight. When the last stage's pipeline schedule holds several
    forwards before their backwards (GPipe, deferred weight passes), the loop calls
    :meth:`use_two_pass_loss` on every such module of that stage.
    """

    def use_two_pass_loss(self) -> bool:
        """Compute the gradients in the backward instead, unless the mode was chosen explicitly.

        Returns:
            Whether the mode changed (False: an explicit choice is kept).
        """
        ...


def default_init_weights(module: nn.Module) -> None:
    """``module.init_weights()`` if it exists, else ``reset_parameters()`` of every submodule."""
    init = getattr(module, "init_weights", None)
    if callable(init):
        init()
        return
    for m in module.modules():
        reset = getattr(m, "reset_parameters", None)
        if callable(reset):
            reset()


class ModuleProvider:
    """A :class:`ModelProvider` from a factory function, for models the user already has.

    Args:
        factory: ``factory()`` for an unsplit model, or ``factory(stage_index, num_stages)`` for
            pipeline stages (called under ``torch.device("meta")``).
        parallelize_fn: ``fn(module, ctx, config) -> module`` (default: unchanged; the loop then
            all-reduces plain-tensor gradients over data-parallel ranks itself).
        init_fn: initialises a materialised module (default :func:`default_init_weights`).
        initial_weights: ``fn(modules)`` that loads weights after initialisation.
        flops_per_token: a number, ``fn(seq_len) -> float``, or None.
        stages: whether ``factory`` takes ``(stage_index, num_stages)``.
        after_optimizer_step: ``fn(modules, ctx)`` run after every optimizer step (default: nothing).
    """

    def __init__(
        self,
        factory: Callable[..., nn.Module],
        *,
        parallelize_fn: Callable[[nn.Module, DistributedContext | None, TrainerConfig], nn.Module]
        | None = None,
        init_fn: Callable[[nn.Module], None] | None = None,
        initial_weights: Callable[[Sequence[nn.Module]], None] | None = None,
        flops_per_token: float | Callable[[int], float] | None = None,
        stages: bool = False,
        after_optimizer_step: Callable[[Sequence[nn.Module], DistributedContext | None], None] | None = None,
    ) -> None:
        self.factory = factory
        self.parallelize_fn = parallelize_fn
        self.init_fn = init_fn or default_init_weights
        self.initial_weights = initial_weights
        self._flops = flops_per_token
        self.stages = stages
        self._after_step = after_optimizer_step

    def build_stage(self, stage_index: int, num_stages: int) -> nn.Module:
        if num_stages > 1 and not self.stages:
            raise ValueError(
                "ModuleProvider: pipeline parallelism needs stages=True and factory(stage_index, num_stages)"
            )
        with torch.device("meta"):
            return self.factory(stage_index, num_stages) if self.stages else self.factory()

    def parallelize(
        self, module: nn.Module, ctx: DistributedContext | None, config: TrainerConfig
    ) -> nn.Module:
        return module if self.parallelize_fn is None else self.parallelize_fn(module, ctx, config)

    def materialize(self, module: nn.Module, device: torch.device) -> None:
        materialize(module, device)  # to_empty, keeping tied parameters tied
        with torch.no_grad():
            init_as_one_process(module, lambda: self.init_fn(module))

    def load_initial_weights(self, modules: Sequence[nn.Module]) -> None:
        if self.initial_weights is not None:
            self.initial_weights(modules)

    def flops_per_token(self, seq_len: int) -> float | None:
        if self._flops is None or isinstance(self._flops, int | float):
            return self._flops
        return self._flops(seq_len)

    def after_optimizer_step(self, modules: Sequence[nn.Module], ctx: DistributedContext | None) -> None:
        if self._after_step is not None:
            self._after_step(modules, ctx)


@dataclass(frozen=True)
class LossOutput:
    """What a task's loss returns for one microbatch (device tensors: reading them needs no host sync).

    Attributes:
        objective: the scalar to differentiate, as a *sum* over the microbatch's loss tokens; the
            loop divides it by the step's global token count (so the step's gradient is the
            token-weighted mean over all microbatches and data-parallel ranks).
        loss_sum: detached sum of the reported loss (e.g. cross-entropy without auxiliary terms).
        num_tokens: loss tokens in the microbatch (a 0-d tensor or an int).
        metrics: extra metrics as ``name -> (value, weight)``, averaged with those weights.
    """

    objective: torch.Tensor
    loss_sum: torch.Tensor
    num_tokens: torch.Tensor | int
    metrics: Mapping[str, tuple[float | torch.Tensor, float | torch.Tensor]] = field(default_factory=dict)


@runtime_checkable
class Task(Protocol):
    """What the loop needs to know about a batch: the inputs of each model stage and the loss.

    The loop itself names no batch key: it hands the task the whole (micro)batch.
    """

    def stage_inputs(self, batch: Batch, stage_index: int, num_stages: int) -> dict[str, torch.Tensor]:
        """Keyword tensors that stage ``stage_index`` of ``num_stages`` takes from ``batch`` (besides
        the previous stage's outputs; the only stage when ``num_stages == 1``)."""
        ...

    def num_loss_tokens(self, batch: Batch) -> int:
        """Tokens of ``batch`` that count in the loss (known before the forward; ``batch`` on the host)."""
        ...

    def loss(self, outputs: Mapping[str, torch.Tensor], batch: Batch) -> LossOutput:
        """The loss of the last stage's ``outputs`` against ``batch``'s targets."""
        ...


class CausalLMTask:
    """Next-token prediction: ``labels`` are aligned targets, ``ignore_index`` marks skipped positions.

    The first stage gets every batch tensor except ``labels`` (``input_ids``, ``position_ids``,
    ``document_ids``, ``attention_mask`` when present), or only ``input_keys`` when given; later
    pipeline stages get the same tensors except ``input_ids``. The last stage must return ``logits``
    ``[B, T, V]`` — or, with ``labels_to_model=True`` (it then also gets ``labels``), compute the loss
    itself and return ``loss_sum`` (summed over tokens; e.g. fused linear cross-entropy). An
    ``aux_loss`` output (a per-microbatch mean such as MoE load balancing) is added to the objective,
    weighted by the microbatch's tokens, and logged as ``aux_loss``.
    """

    def __init__(
        self,
        ignore_index: int = -100,
        input_keys: Sequence[str] | None = None,
        labels_to_model: bool = False,
        aux_loss_key: str = "aux_loss",
    ) -> None:
        self.ignore_index = ignore_index
        self.input_keys = tuple(input_keys) if input_keys is not None else None
        self.labels_to_model = labels_to_model
        self.aux_loss_key = aux_loss_key

    def stage_inputs(self, batch: Batch, stage_index: int, num_stages: int) -> dict[str, torch.Tensor]:
        if self.input_keys is not None:
            missing = [k for k in self.input_keys if k not in batch]
            if missing:
                raise KeyError(f"CausalLMTask: batch has no {missing} (has {sorted(batch)})")
            out = {k: batch[k] for k in self.input_keys}
        else:
            out = {k: v for k, v in batch.items() if k != "labels"}
        if stage_index > 0:
            out.pop("input_ids", None)
        if self.labels_to_model and stage_index == num_stages - 1:
            out["labels"] = batch["labels"]
        return out

    def num_loss_tokens(self, batch: Batch) -> int:
        if "labels" not in batch:
            raise KeyError(f"CausalLMTask: batch has no 'labels' (has {sorted(batch)})")
        return int((batch["labels"] != self.ignore_index).sum())

    def loss(self, outputs: Mapping[str, torch.Tensor], batch: Batch) -> LossOutput:
        labels = batch["labels"]
        n = (labels != self.ignore_index).sum()
        if "loss_sum" in outputs:
            loss_sum = outputs["loss_sum"]
        elif "logits" in outputs:
            logits = outputs["logits"]
            loss_sum = F.cross_entropy(
                logits.reshape(-1, logits.shape[-1]).float(),
                labels.reshape(-1),
                ignore_index=self.ignore_index,
                reduction="sum",
            )
        else:
            raise KeyError(
                f"CausalLMTask: the model returned {sorted(outputs)}; expected 'logits' or 'loss_sum'"
            )
        objective = loss_sum
        metrics: dict[str, tuple[float | torch.Tensor, float | torch.Tensor]] = {}
        aux = outputs.get(self.aux_loss_key)
        if aux is not None:
            objective = objective + aux * n
            metrics[self.aux_loss_key] = (aux.detach(), n)
        return LossOutput(objective=objective, loss_sum=loss_sum.detach(), num_tokens=n, metrics=metrics)


@runtime_checkable
class DataProvider(Protocol):
    """Builds this rank's loaders for the batch domain's dp coordinate."""

    def build_loader(self, config: TrainerConfig, plan: BatchPlan, dp_rank: int) -> DistributedDataLoader:
        """A stateful loader yielding this rank's training batch per step."""
        ...

    def build_validation_loader(
        self, config: TrainerConfig, plan: BatchPlan, dp_rank: int
    ) -> DistributedDataLoader | None:
        """A stateful loader over held-out data for ``config.evaluation`` (None: no validation data)."""
        ...


@runtime_checkable
class OptimizerProvider(Protocol):
    """Builds the optimizer of one local model part (called once per pipeline stage on this rank)."""

    def __call__(self, module: nn.Module, config: TrainerConfig) -> torch.optim.Optimizer:
        """An optimizer over ``module``'s trainable parameters."""
        ...


@runtime_checkable
class LRScheduler(Protocol):
    """What the trainer calls on a learning-rate scheduler (torch's ``LRScheduler`` and
    :class:`~plait.loop.optim.PiecewiseLR` both have it)."""

    def step(self) -> None:
        """Advance one optimizer step."""
        ...

    def get_last_lr(self) -> list[float]:
        """The learning rate of each param group, as last set."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """Checkpointable state."""
        ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s state (and re-apply the rate)."""
        ...


class LRSchedulerProvider(Protocol):
    """Builds the LR scheduler driving all local optimizers."""

    def __call__(self, optimizers: Sequence[torch.optim.Optimizer], config: TrainerConfig) -> LRScheduler:
        """A scheduler whose ``step()`` is called after every optimizer step."""
        ...


class DatasetProvider:
    """A :class:`DataProvider` over map-style datasets (e.g. :class:`~plait.loop.data.PackedTokens`).

    Batch sizes come from the :class:`~plait.loop.BatchPlan`, the shuffling seed from
    ``config.run.seed``. The validation loader reads ``validation`` in order (no shuffling).

    Args:
        dataset: the training dataset, or a zero-argument function building it (called once per rank).
        validation: held-out dataset (or a function building it) for evaluation.
        collate_fn: default :class:`~plait.loop.data.PadCollator`.
        shuffle: shuffle each epoch.
        lengths: per-sample lengths for length bucketing.
        bucket_buffer_batches: length-sort window in global batches.
        num_workers: loader worker processes.
    """

    def __init__(
        self,
        dataset: Any,
        *,
        validation: Any = None,
        collate_fn: Callable[[Sequence[Mapping[str, Any]]], Batch] | None = None,
        shuffle: bool = True,
        lengths: Sequence[int] | None = None,
        bucket_buffer_batches: int = 0,
        num_workers: int = 0,
    ) -> None:
        self.dataset = dataset
        self.validation = validation
        self.collate_fn = collate_fn
        self.shuffle = shuffle
        self.lengths = lengths
        self.bucket_buffer_batches = bucket_buffer_batches
        self.num_workers = num_workers

    def build_loader(self, config: TrainerConfig, plan: BatchPlan, dp_rank: int) -> DistributedDataLoader:
        from plait.loop.data import DistributedDataLoader

        return DistributedDataLoader(
            _build(self.dataset),
            global_batch_size=plan.global_batch_size,
            dp_rank=dp_rank,
            dp_size=plan.dp_size,
            collate_fn=self.collate_fn,
            shuffle=self.shuffle,
            seed=config.run.seed,
            lengths=self.lengths,
            bucket_buffer_batches=self.bucket_buffer_batches,
            num_workers=self.num_workers,
        )

    def build_validation_loader(
        self, config: TrainerConfig, plan: BatchPlan, dp_rank: int
    ) -> DistributedDataLoader | None:
        from plait.loop.data import DistributedDataLoader

        if self.validation is None:
            return None
        return DistributedDataLoader(
            _build(self.validation),
            global_batch_size=plan.global_batch_size,
            dp_rank=dp_rank,
            dp_size=plan.dp_size,
            collate_fn=self.collate_fn,
            shuffle=False,
        )


def _build(dataset: Any) -> Any:
    return dataset() if callable(dataset) and not hasattr(dataset, "__getitem__") else dataset
