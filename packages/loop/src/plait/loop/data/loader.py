"""A stateful, distributed, exactly resumable loader that yields each rank's batch per step."""

from __future__ import annotations

import itertools
import signal
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from plait.loop.config.loading import ConfigError
from plait.loop.data.collate import PadCollator
from plait.loop.data.sampler import GlobalBatchPlan

__all__ = ["DistributedDataLoader"]

Batch = dict[str, torch.Tensor]


def _identity(x: Any) -> Any:
    return x


def _ignore_sigint(worker_id: int) -> None:
    """A worker ignores Ctrl-C: the terminal sends it to the whole process group, and the training
    process decides (finish the step, save, exit); a worker that died of it would fail the next batch."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class _StepDataset(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Item ``k`` = one rank's collated share of global step ``k`` (runs in workers)."""

    def __init__(self, loader: DistributedDataLoader) -> None:
        self.dataset = loader.dataset
        self.plan = loader.plan
        self.collate_fn = loader.collate_fn
        self.dp_rank, self.dp_size = loader.dp_rank, loader.dp_size

    def __getitem__(self, k: int) -> Batch:
        return self.collate_fn([self.dataset[i] for i in self.plan.rank_slice(k, self.dp_rank, self.dp_size)])

    def __len__(self) -> int:  # pragma: no cover - the sampler is infinite
        return 2**62


class DistributedDataLoader:
    """Yields, per optimizer step, the batch this data-parallel rank trains on (one collated dict).

    The global order comes from a :class:`GlobalBatchPlan`; rank ``r`` of ``dp_size`` reads the
    ``r``-th contiguous share of each global batch, collated at once (so padded to the step's longest
    sample); the executor cuts it into microbatches. The state is a single global counter (global
    batches consumed, counted when a step's batch is handed to the caller, not when workers prefetch
    it), so a resume is exact — and valid for a different ``dp_size`` or microbatch size as long as the
    global batch size is the same.

    Args:
        dataset: map-style dataset (``__len__``, ``__getitem__`` -> dict of 1-d sequences).
        global_batch_size: samples per step over all dp ranks.
        dp_rank: this rank's index in the batch domain's dp dimension.
        dp_size: the dp size.
        collate_fn: list of samples -> dict of tensors (default :class:`PadCollator`).
        shuffle: shuffle each epoch.
        seed: shuffling seed.
        lengths: per-sample lengths for length-bucketed batches.
        bucket_buffer_batches: length-sort window in global batches (see :class:`GlobalBatchPlan`).
        num_workers: background worker processes (0: load in the training process).
        prefetch_factor: steps each worker loads ahead.
        pin_memory: pin host memory (for CUDA copies).
    """

    def __init__(
        self,
        dataset: Any,
        *,
        global_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        collate_fn: Callable[[Sequence[Mapping[str, Any]]], Batch] | None = None,
        shuffle: bool = True,
        seed: int = 0,
        lengths: Sequence[int] | None = None,
        bucket_buffer_batches: int = 0,
        num_workers: int = 0,
        prefetch_factor: int = 2,
        pin_memory: bool = False,
    ) -> None:
        if global_batch_size % dp_size:
            raise ValueError(
                f"global_batch_size={global_batch_size} is not a multiple of dp_size ({dp_size})"
            )
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} is outside [0, {dp_size})")
        self.dataset = dataset
        self.global_batch_size = global_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.collate_fn = collate_fn or PadCollator()
        self.num_workers, self.prefetch_factor, self.pin_memory = num_workers, prefetch_factor, pin_memory
        self.plan = GlobalBatchPlan(
            len(dataset),
            global_batch_size,
            shuffle=shuffle,
            seed=seed,
            lengths=lengths,
            bucket_buffer_batches=bucket_buffer_batches,
        )
        self.batches_consumed = 0
        self._it: Iterator[Batch] | None = None

    @property
    def epoch(self) -> int:
        """The epoch of the next batch."""
        return self.batches_consumed // self.plan.batches_per_epoch

    def _make_iter(self) -> Iterator[Batch]:
        steps = _StepDataset(self)
        if self.num_workers == 0:
            return (steps[k] for k in itertools.count(self.batches_consumed))
        dl = torch.utils.data.DataLoader(
            steps,
            batch_size=None,
            sampler=itertools.count(self.batches_consumed),  # type: ignore[arg-type]
            collate_fn=_identity,
            num_workers=self.num_workers,
            worker_init_fn=_ignore_sigint,
            prefetch_factor=self.prefetch_factor,
            pin_memory=self.pin_memory,
            persistent_workers=False,
        )
        return iter(dl)

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        """The next step's batch of this rank (an endless stream across epochs)."""
        if self._it is None:
            self._it = self._make_iter()
        batch = next(self._it)
        self.batches_consumed += 1
        return batch

    def state_dict(self) -> dict[str, Any]:
        """Global, dp-size-independent state: ``batches_consumed`` (+ what it must be checked against:
        for a :class:`~plait.loop.data.MixtureDataset`, its sources' sizes, weights and seed too)."""
        state: dict[str, Any] = {
            "batches_consumed": self.batches_consumed,
            "samples_consumed": self.batches_consumed * self.global_batch_size,
            "global_batch_size": self.global_batch_size,
            "num_samples": self.plan.num_samples,
            "seed": self.plan.seed,
        }
        if hasattr(self.dataset, "check_state"):
            state["mixture"] = self.dataset.state_dict()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume after ``state["batches_consumed"]`` global batches (any dp size or microbatch size).

        Raises:
            ConfigError: when the dataset size, seed or global batch size (or a mixture's sources' sizes,
                weights or seed) differ from the saved ones (the global order would differ and samples
                would repeat or be skipped); a mixture names its sources' sizes first.
        """
        if "mixture" in state and hasattr(self.dataset, "check_state"):
            self.dataset.check_state(state["mixture"])
        for key, mine in (
            ("num_samples", self.plan.num_samples),
            ("seed", self.plan.seed),
            ("global_batch_size", self.global_batch_size),
        ):
            if key in state and int(state[key]) != mine:
                raise ConfigError(
                    f"data loader state: {key}={state[key]} was saved, but this loader has {key}={mine} "
                    "(the data changed since the checkpoint: give the run the data it had, or a new run directory)"
                )
        self.batches_consumed = int(state["batches_consumed"])
        self._it = None
