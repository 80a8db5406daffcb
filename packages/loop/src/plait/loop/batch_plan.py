"""The :class:`BatchPlan`: every batch count of a training step, derived once from the config and the mesh.

The plan is built from the sections it reads (``batching``, ``mesh``, ``pipeline``), never from the
whole config: this module does not import :mod:`plait.loop.config` (the config imports it to check
its batch arithmetic).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from plait.pipelining import BaseScheduleConfig, parse_schedule_config
from pydantic import BaseModel

if TYPE_CHECKING:
    from plait.dist_core import DeviceMeshParameters

__all__ = ["BatchPlan", "BatchSizes"]


class BatchSizes(Protocol):
    """The batch sizes a plan is built from (the ``batching`` section, :class:`plait.loop.BatchingConfig`)."""

    @property
    def global_batch_size(self) -> int: ...
    @property
    def microbatch_size(self) -> int: ...
    @property
    def seq_len(self) -> int: ...


class _Sections(Protocol):
    """A config with ``batching`` and ``mesh`` sections (:class:`plait.loop.TrainerConfig`)."""

    @property
    def batching(self) -> BatchSizes: ...
    @property
    def mesh(self) -> DeviceMeshParameters: ...


@dataclass(frozen=True)
class BatchPlan:
    """Per-rank batch, microbatch size and count of a step, counted in sequences (samples).

    Built once from the config's ``batching`` and ``mesh`` sections (:meth:`from_sections`, or
    :meth:`from_config`); the data loader reads :attr:`rank_batch_size` samples per step
    (one step batch per rank), the executor splits them into :attr:`num_microbatches` microbatches of
    :attr:`microbatch_size`, the pipeline schedule runs :attr:`num_microbatches` (= the gradient
    accumulation steps), and the loop divides the summed loss by the step's global token count.

    Attributes:
        global_batch_size: samples per optimizer step over all data-parallel ranks
            (``batching.global_batch_size``).
        microbatch_size: samples per forward/backward (``batching.microbatch_size``).
        dp_size: data-parallel size (``mesh.data_replicate x mesh.data_shard``).
        seq_len: tokens per sample (``batching.seq_len``).
        cp_size: context-parallel size (``mesh.context_shard x mesh.context_replicate``): the ranks
            of a context group share each sample and hold ``seq_len / cp_size`` of its tokens (the
            load-balanced layout of :func:`plait.dist_core.shard_batch`).

    Raises:
        ValueError: naming ``batching.global_batch_size`` when it is not a multiple of
            ``microbatch_size x dp_size``, or ``batching.seq_len`` when context parallelism is on
            and it is not a multiple of ``2 x cp_size``.
    """

    global_batch_size: int
    microbatch_size: int
    dp_size: int
    seq_len: int
    cp_size: int = 1

    def __post_init__(self) -> None:
        if self.global_batch_size % (self.microbatch_size * self.dp_size):
            raise ValueError(
                f"batching.global_batch_size={self.global_batch_size} is not a multiple of "
                f"batching.microbatch_size ({self.microbatch_size}) x data-parallel size ({self.dp_size})"
            )
        if self.cp_size > 1 and self.seq_len % (2 * self.cp_size):
            raise ValueError(
                f"batching.seq_len={self.seq_len} must be a multiple of 2 x context-parallel size "
                f"({2 * self.cp_size}): context parallelism cuts every row into 2 chunks per context rank"
            )

    @classmethod
    def from_sections(cls, batching: BatchSizes, mesh: DeviceMeshParameters) -> BatchPlan:
        """The plan of ``batching`` on ``mesh``'s data-parallel and context sizes."""
        dp = int(mesh.data_replicate) * int(mesh.data_shard)
        cp = int(mesh.context_shard) * int(mesh.context_replicate)
        return cls(batching.global_batch_size, batching.microbatch_size, dp, batching.seq_len, cp)

    @classmethod
    def from_config(cls, config: _Sections) -> BatchPlan:
        """The plan of ``config.batching`` on ``config.mesh`` (:meth:`from_sections`; reads nothing else)."""
        return cls.from_sections(config.batching, config.mesh)

    @property
    def rank_batch_size(self) -> int:
        """Samples per step on one data-parallel rank (the loader's step batch)."""
        return self.global_batch_size // self.dp_size

    @property
    def num_microbatches(self) -> int:
        """Microbatches per rank and step: the gradient-accumulation steps and the schedule's count."""
        return self.rank_batch_size // self.microbatch_size

    def schedule(self, pipeline: BaseModel | Mapping[str, Any] | None) -> BaseScheduleConfig:
        """The pipeline schedule of the ``pipeline`` section (1F1B when None) for this plan's microbatches.

        ``pipeline`` is the section (:class:`plait.loop.PipelineConfig`) or its options as a mapping.

        The loop runs it with ``loss_reduction="sum"`` (it divides by the global token count itself).

        Raises:
            ValueError: naming ``pipeline.num_microbatches`` when it is given and differs from
                :attr:`num_microbatches`, or the schedule's own field errors.
        """
        if pipeline is None:
            options: dict[str, Any] = {}
        elif isinstance(pipeline, BaseModel):
            options = pipeline.model_dump(exclude_none=True)
        else:
            options = {k: v for k, v in pipeline.items() if v is not None}
        given = options.pop("num_microbatches", None)
        if given is not None and given != self.num_microbatches:
            raise ValueError(
                f"pipeline.num_microbatches={given} must equal the gradient-accumulation steps "
                f"{self.num_microbatches} = batching.global_batch_size / (batching.microbatch_size x dp size)"
            )
        if options.pop("loss_reduction", "sum") != "sum":
            raise ValueError(
                "pipeline.loss_reduction: the loop sums microbatch losses itself; leave it unset"
            )
        options.setdefault("kind", "1f1b")
        return parse_schedule_config(
            {**options, "num_microbatches": self.num_microbatches, "loss_reduction": "sum"}
        )
