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
from plait.pipelining import PipelineScheduleConfig
from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["TrainerConfig", "dp_size_of"]


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
    # plait.pipelining's schedule config union (``kind`` = 1f1b, interleaved_1f1b, zbv, dualpipev, ...),
    # used when mesh.pipeline > 1 (None: 1F1B). ``num_microbatches`` defaults to the derived
    # gradient-accumulation steps; the loop always runs it with loss_reduction="sum" and normalises
    # by the global token count itself.
    pipeline: PipelineScheduleConfig | None = None
    optimizer: OptimizerConfig = AdamWConfig()
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

    @model_validator(mode="before")
    @classmethod
    def _fill_microbatches(cls, data: Any) -> Any:
        pipe = data.get("pipeline") if isinstance(data, dict) else None
        if isinstance(pipe, dict) and "num_microbatches" not in pipe:
            try:
                batching = BatchingConfig.model_validate(data.get("batching", {}))
                mesh = DeviceMeshParameters.model_validate(data.get("mesh", {}))
                n = batching.grad_accum_steps(dp_size_of(mesh))
            except (ValueError, TypeError):
                return data  # field validation reports the real error
            data = {**data, "pipeline": {**pipe, "num_microbatches": n}}
        return data

    @model_validator(mode="after")
    def _check(self) -> TrainerConfig:
        accum = self.batching.grad_accum_steps(dp_size_of(self.mesh))
        if self.pipeline is not None and self.pipeline.num_microbatches != accum:
            raise ValueError(
                f"pipeline.num_microbatches={self.pipeline.num_microbatches} must equal the gradient-accumulation "
                f"steps {accum} = batching.global_batch_size / (batching.microbatch_size x dp size)"
            )
        self.lr_schedule.resolve(self.run.steps)
        return self

    @property
    def dp_size(self) -> int:
        """The data-parallel size of the mesh section."""
        return dp_size_of(self.mesh)

    @property
    def num_pipeline_stages(self) -> int:
        """Model stages over the whole pipeline: ``mesh.pipeline`` x the schedule's stages per rank
        (1 without pipeline parallelism). Config classes that know the model check it against the
        model's layers."""
        pp = int(self.mesh.pipeline)
        if pp == 1:
            return 1
        from plait.pipelining import OneFOneBConfig

        schedule = self.pipeline or OneFOneBConfig(num_microbatches=self.grad_accum_steps)
        return int(schedule.topology(pp).num_stages)

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
