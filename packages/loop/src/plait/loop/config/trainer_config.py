"""``TrainerConfig``: the whole loop's configuration in one frozen, validated pydantic model."""

from __future__ import annotations

from typing import ClassVar, Literal

from plait.loop.batch_plan import BatchPlan
from plait.loop.config._mesh import DeviceMeshParameters
from plait.loop.config.sections import (
    AdamWConfig,
    BatchingConfig,
    CheckpointConfig,
    DeterminismConfig,
    EvaluationConfig,
    FSDPConfig,
    GCConfig,
    GradClipConfig,
    GradientConfig,
    LoggingConfig,
    OptimizerConfig,
    PipelineConfig,
    ProfilingConfig,
    RunConfig,
    TimeoutConfig,
)
from plait.loop.optim.schedules import LRScheduleConfig
from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["TrainerConfig", "dp_size_of"]


def dp_size_of(mesh: DeviceMeshParameters) -> int:
    """Data-parallel size = data_replicate x data_shard (the batch domain's ``dp`` dimension)."""
    return int(mesh.data_replicate) * int(mesh.data_shard)


class TrainerConfig(BaseModel):
    """Everything the :class:`~plait.loop.Trainer` needs besides the providers.

    Load it with :func:`~plait.loop.load_config` (TOML, YAML, JSON + dotted overrides).

    ``fixed_on_resume`` lists the fields (dotted; a section name covers all of it) that a resume may
    not change: a subclass adds its own sections (the ``model`` and ``data`` of a subclass that has
    them are covered already). Every other field may change on resume and is applied.
    """

    fixed_on_resume: ClassVar[tuple[str, ...]] = (
        "batching.global_batch_size",
        "batching.seq_len",
        "run.seed",
        "optimizer.name",
        "model",
        "data",
    )

    # finite floats also in the fields a subclass adds (its own nested models say so themselves)
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    run: RunConfig = RunConfig()
    mesh: DeviceMeshParameters = Field(default_factory=DeviceMeshParameters)
    batching: BatchingConfig = BatchingConfig()
    pipeline: PipelineConfig | None = None  # the schedule when mesh.pipeline > 1 (None: 1F1B)
    optimizer: OptimizerConfig = AdamWConfig()
    lr_schedule: LRScheduleConfig = LRScheduleConfig()
    grad_clip: GradClipConfig = GradClipConfig()
    gradients: GradientConfig = GradientConfig()
    fsdp: FSDPConfig = FSDPConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    logging: LoggingConfig = LoggingConfig()
    profiling: ProfilingConfig = ProfilingConfig()
    timeouts: TimeoutConfig = TimeoutConfig()
    gc: GCConfig = GCConfig()
    determinism: DeterminismConfig = DeterminismConfig()
    evaluation: EvaluationConfig = EvaluationConfig()

    @model_validator(mode="after")
    def _check(self) -> TrainerConfig:
        plan = BatchPlan.from_sections(
            self.batching, self.mesh
        )  # checks the batch arithmetic, naming the fields
        if self.mesh.pipeline > 1 or self.pipeline is not None:
            plan.schedule(self.pipeline)
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
        plan = BatchPlan.from_sections(self.batching, self.mesh)
        return int(plan.schedule(self.pipeline).topology(pp).num_stages)

    def device_type(self) -> Literal["cpu", "cuda"]:
        """``run.device`` with ``auto`` resolved (CUDA when available)."""
        import torch

        if self.run.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.run.device
