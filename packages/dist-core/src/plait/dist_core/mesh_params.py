"""Parallelism degrees of a run: :class:`DeviceMeshParameters`."""

from __future__ import annotations

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, model_validator

_DEGREE_FIELDS = (
    "pipeline",
    "data_replicate",
    "data_shard",
    "context_shard",
    "context_replicate",
    "tensor",
)


def _degree(short: str, long: str, doc: str) -> int:
    # ge=1 makes pydantic's error name the field; the aliases accept the long and short spellings.
    return Field(  # type: ignore[no-any-return]
        default=1,
        ge=1,
        strict=True,
        description=doc,
        validation_alias=AliasChoices(long.removesuffix("_parallel"), long, short),
    )


class DeviceMeshParameters(BaseModel):
    """Degrees of each parallelism of a run (all default to 1).

    Field names follow the mesh dimensions they size. Each field also accepts a long and a short
    alias on input, e.g. ``DeviceMeshParameters(pipeline=2)``, ``(pipeline_parallel=2)`` or
    ``(pp=2)``:

    - ``pipeline`` (``pipeline_parallel``, ``pp``): mesh dim ``pp``
    - ``data_replicate`` (``data_parallel_replicate``, ``dp_replicate``): ``dp_replicate``
    - ``data_shard`` (``data_parallel_shard``, ``dp_shard``): ``dp_shard``
    - ``context_shard`` (``context_parallel_shard``, ``cp_shard``): ``cp_shard``
    - ``context_replicate`` (``context_parallel_replicate``, ``cp_replicate``): ``cp_replicate``
    - ``tensor`` (``tensor_parallel``, ``tp``): ``tp``
    - ``expert`` (``expert_parallel``, ``ep``): ``ep_shard`` of the expert domain

    The world size is the product of all degrees except ``expert``: expert parallelism re-uses
    the data and context ranks, so ``expert`` must divide
    ``data_replicate * data_shard * context_shard * context_replicate``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    pipeline: int = _degree("pp", "pipeline_parallel", "pipeline stages")
    data_replicate: int = _degree(
        "dp_replicate", "data_parallel_replicate", "data-parallel replicas (DDP/HSDP)"
    )
    data_shard: int = _degree("dp_shard", "data_parallel_shard", "data-parallel shards (FSDP)")
    context_shard: int = _degree(
        "cp_shard", "context_parallel_shard", "context-parallel ranks sharding parameters"
    )
    context_replicate: int = _degree(
        "cp_replicate", "context_parallel_replicate", "context-parallel ranks replicating parameters"
    )
    tensor: int = _degree("tp", "tensor_parallel", "tensor-parallel ranks")
    expert: int = _degree(
        "ep", "expert_parallel", "expert-parallel ranks (taken from the data/context ranks)"
    )

    @model_validator(mode="after")
    def _expert_divides_data_context(self) -> DeviceMeshParameters:
        if self.data_context % self.expert != 0:
            raise ValueError(
                f"expert={self.expert} must divide data_replicate*data_shard*context_shard*context_replicate"
                f" = {self.data_replicate}*{self.data_shard}*{self.context_shard}*{self.context_replicate}"
                f" = {self.data_context}"
            )
        return self

    @property
    def data(self) -> int:
        """All data-parallel ranks: ``data_replicate * data_shard``."""
        return self.data_replicate * self.data_shard

    @property
    def context(self) -> int:
        """All context-parallel ranks: ``context_shard * context_replicate``."""
        return self.context_shard * self.context_replicate

    @property
    def data_context(self) -> int:
        """Ranks that see different tokens within one pipeline stage and tensor group."""
        return self.data * self.context

    @property
    def world_size(self) -> int:
        """Number of ranks these degrees need."""
        return self.pipeline * self.data_context * self.tensor

    @property
    def is_single_process(self) -> bool:
        """True when every degree is 1."""
        return self.world_size == 1 and self.expert == 1

    def validate_world_size(self, world_size: int) -> None:
        """Raise ``ValueError`` unless the degrees multiply to ``world_size``.

        Args:
            world_size: the number of ranks actually launched (e.g. torchrun's ``WORLD_SIZE``).
        """
        if world_size != self.world_size:
            degrees = " * ".join(f"{name}={getattr(self, name)}" for name in _DEGREE_FIELDS)
            raise ValueError(
                f"DeviceMeshParameters need world_size {degrees} = {self.world_size}, but the world size is "
                f"{world_size}"
            )
