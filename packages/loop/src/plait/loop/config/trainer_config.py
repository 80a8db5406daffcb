"""``TrainerConfig``: the whole loop's configuration in one frozen, validated pydantic model."""

from __future__ import annotations

from typing import Any, Literal

from plait.loop.config._mesh import DeviceMeshParameters
from plait.loop.config.sections import (
    AdamWConfig,
    BatchingConfig,
    CheckpointConfig,
    DeterminismConfig,
    GCConfig,
    GradClipConfig,
    GradientConfig,
    LoggingConfig,
    OptimizerConfig,
    ProfilingConfig,
    RunConfig,
    TimeoutConfig,
)
from plait.loop.optim.schedules import LRScheduleConfig
from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["PipelineConfig", "TrainerConfig", "dp_size_of"]


class PipelineConfig(BaseModel):
    """Pipeline schedule used when ``mesh.pipeline > 1`` (ignored for pp=1).

    Attributes:
        schedule: a schedule name understood by plait.pipelining (e.g. ``"1f1b"``, ``"gpipe"``,
            ``"interleaved_1f1b"``, ``"zbv"``, ``"dualpipev"``).
        stages_per_rank: virtual stages per pipeline rank (2 for V-shaped schedules).
        options: extra keyword arguments of the schedule builder.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    schedule: str = "1f1b"
    stages_per_rank: int = Field(1, ge=1)
    options: dict[str, Any] = Field(default_factory=dict)


def dp_size_of(mesh: DeviceMeshParameters) -> int:
    """Data-parallel size = data_replicate x data_shard (the batch domain's ``dp`` dimension)."""
    return int(mesh.data_replicate) * int(mesh.data_shard)


class TrainerConfig(BaseModel):
    """Everything the :class:`~plait.loop.Trainer` needs besides the providers.

    Load it with :func:`~plait.loop.load_config` (TOML, YAML, JSON + dotted overrides).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    run: RunConfig = RunConfig()
    mesh: DeviceMeshParameters = Field(default_factory=DeviceMeshParameters)
    batching: BatchingConfig = BatchingConfig()
    pipeline: PipelineConfig = PipelineConfig()
    optimizer: OptimizerConfig = Field(default_factory=AdamWConfig)
    lr_schedule: LRScheduleConfig = LRScheduleConfig()
    grad_clip: GradClipConfig = GradClipConfig()
    gradients: GradientConfig = GradientConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    logging: LoggingConfig = LoggingConfig()
    profiling: ProfilingConfig = ProfilingConfig()
    timeouts: TimeoutConfig = TimeoutConfig()
    gc: GCConfig = GCConfig()
    determinism: DeterminismConfig = DeterminismConfig()
    # Free-form, user-owned sections (model hyper-parameters, data paths): validated by the user's providers.
    extras: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _check(self) -> TrainerConfig:
        self.batching.grad_accum_steps(dp_size_of(self.mesh))
        self.lr_schedule.resolve(self.run.steps)
        return self

    @property
    def dp_size(self) -> int:
        """The data-parallel size of the mesh section."""
        return dp_size_of(self.mesh)

    @property
    def grad_accum_steps(self) -> int:
        """Microbatches per rank per optimizer step."""
        return self.batching.grad_accum_steps(self.dp_size)

    def device_type(self) -> Literal["cpu", "cuda"]:
        """``run.device`` with ``auto`` resolved (CUDA when available)."""
        import torch

        if self.run.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.run.device
