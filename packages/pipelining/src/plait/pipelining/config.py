"""Schedule configs, the schedule registry and the executor factory.

The registry is the one list of schedule kinds: every schedule, built-in or a user's, is registered
with :func:`register_schedule`, and :data:`PipelineScheduleConfig` (the pydantic field type),
:func:`parse_schedule_config`, the error messages and :func:`registered_schedules` read it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

import torch
import torch.distributed as dist
from plait.pipelining import schedules as S
from plait.pipelining.executor import OfflineExecutor, PipelineExecutor
from plait.pipelining.program import Program
from plait.pipelining.runner import BackwardHook, ForwardKwargsFn, LossFn
from plait.pipelining.topology import StageTopology, loop_topology, vshape_topology
from pydantic import BaseModel, ConfigDict, Field, PlainSerializer, PlainValidator
from torch import nn

__all__ = [
    "BaseScheduleConfig",
    "DualPipeVConfig",
    "GPipeConfig",
    "InferenceConfig",
    "Interleaved1F1BConfig",
    "LoopedBFSConfig",
    "LoopedScheduleConfig",
    "OneFOneBConfig",
    "PipelineScheduleConfig",
    "RegisteredSchedule",
    "ZB1PConfig",
    "ZBVConfig",
    "build_pipeline",
    "build_program",
    "parse_schedule_config",
    "register_schedule",
    "registered_schedules",
    "schedule_config_class",
]


class BaseScheduleConfig(BaseModel):
    """Options every schedule has. Subclass it (with a ``kind`` literal) for your own schedule."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # A schedule without backward passes (evaluation, generation): build_pipeline takes no loss_fn.
    forward_only: ClassVar[bool] = False

    kind: str
    num_microbatches: int = Field(ge=1)
    loss_reduction: Literal["mean", "sum"] = "mean"

    def topology(self, pp_size: int) -> StageTopology:
        """Stage placement this schedule uses on `pp_size` ranks: one stage per rank (override it, or
        subclass :class:`LoopedScheduleConfig` for several stages per rank)."""
        return loop_topology(pp_size)

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        if "stages_per_rank" in cls.model_fields and cls.topology is BaseScheduleConfig.topology:
            raise TypeError(
                f"{cls.__name__} declares stages_per_rank but places one stage per rank: subclass "
                "LoopedScheduleConfig (or override topology)"
            )


class LoopedScheduleConfig(BaseScheduleConfig):
    """Base of schedules with ``stages_per_rank`` stages on each rank, placed round-robin (stage ``s`` on
    rank ``s % pp``)."""

    stages_per_rank: int = Field(1, ge=1)

    def topology(self, pp_size: int) -> StageTopology:
        """The round-robin placement of ``stages_per_rank`` stages per rank on ``pp_size`` ranks."""
        return loop_topology(pp_size, self.stages_per_rank)


class GPipeConfig(BaseScheduleConfig):
    """GPipe: every microbatch's forward, then every backward (one stage per rank)."""

    kind: Literal["gpipe"] = "gpipe"


class LoopedBFSConfig(LoopedScheduleConfig):
    """Looped breadth-first: GPipe over ``stages_per_rank`` stages per rank, placed round-robin."""

    kind: Literal["looped_bfs"] = "looped_bfs"


class OneFOneBConfig(BaseScheduleConfig):
    """1F1B: warm-up forwards, then one forward and one backward alternating (one stage per rank)."""

    kind: Literal["1f1b"] = "1f1b"


class Interleaved1F1BConfig(LoopedScheduleConfig):
    """Interleaved 1F1B over ``stages_per_rank`` (>= 2) stages per rank, placed round-robin."""

    kind: Literal["interleaved_1f1b"] = "interleaved_1f1b"
    stages_per_rank: int = Field(2, ge=2)


class ZB1PConfig(LoopedScheduleConfig):
    """Zero bubble ZB1P: backward split into input and weight passes, weight passes fill the bubbles."""

    kind: Literal["zb1p"] = "zb1p"


class ZBVConfig(BaseScheduleConfig):
    """ZB-V: zero bubble on the V-shape placement (rank ``r`` holds stages ``r`` and ``2pp-1-r``)."""

    kind: Literal["zbv"] = "zbv"

    def topology(self, pp_size: int) -> StageTopology:
        """The V-shape placement on ``pp_size`` ranks."""
        return vshape_topology(pp_size)


class DualPipeVConfig(BaseScheduleConfig):
    """DualPipeV; ``order`` picks plait's greedy list schedule or DeepSeek's reference step order."""

    kind: Literal["dualpipev"] = "dualpipev"
    order: S.DualPipeVOrder = "greedy"

    def topology(self, pp_size: int) -> StageTopology:
        """The V-shape placement on ``pp_size`` ranks."""
        return vshape_topology(pp_size)


class InferenceConfig(LoopedScheduleConfig):
    """Forward-only program over ``stages_per_rank`` stages per rank (evaluation, generation)."""

    forward_only: ClassVar[bool] = True

    kind: Literal["inference"] = "inference"


ScheduleBuilder = Callable[[Any, int], Program]


@dataclass(frozen=True)
class RegisteredSchedule:
    """One entry of the schedule registry.

    Attributes:
        kind: the ``kind`` value that selects it.
        config_cls: its config class (a :class:`BaseScheduleConfig` subclass).
        builder: ``builder(config, pp_size)`` returns the compute-only :class:`Program`.
    """

    kind: str
    config_cls: type[BaseScheduleConfig]
    builder: ScheduleBuilder


_REGISTRY: dict[str, RegisteredSchedule] = {}


def register_schedule(kind: str, config_cls: type[BaseScheduleConfig], builder: ScheduleBuilder) -> None:
    """Register a schedule: `builder(config, pp_size)` returns the compute-only :class:`Program`.

    The built-in schedules are registered with this same call when the package is imported.

    Raises:
        ValueError: if `kind` is already registered, or `config_cls`'s ``kind`` default is another kind.
    """
    if kind in _REGISTRY:
        raise ValueError(f"pipeline schedule {kind!r} is already registered")
    default = config_cls.model_fields["kind"].default
    if isinstance(default, str) and default != kind:
        raise ValueError(f"register_schedule({kind!r}): {config_cls.__name__}.kind defaults to {default!r}")
    _REGISTRY[kind] = RegisteredSchedule(kind, config_cls, builder)


def registered_schedules() -> list[str]:
    """The kinds of every registered schedule, sorted."""
    return sorted(_REGISTRY)


def _registered(kind: object) -> RegisteredSchedule:
    if not isinstance(kind, str) or kind not in _REGISTRY:
        raise ValueError(f"unknown pipeline schedule kind {kind!r}; registered: {registered_schedules()}")
    return _REGISTRY[kind]


def schedule_config_class(kind: str) -> type[BaseScheduleConfig]:
    """The config class registered for `kind`.

    Raises:
        ValueError: naming the registered kinds, if `kind` is not one.
    """
    return _registered(kind).config_cls


register_schedule("gpipe", GPipeConfig, lambda c, pp: S.build_gpipe(pp, c.num_microbatches))
register_schedule(
    "looped_bfs", LoopedBFSConfig, lambda c, pp: S.build_looped_bfs(pp, c.num_microbatches, c.stages_per_rank)
)
register_schedule("1f1b", OneFOneBConfig, lambda c, pp: S.build_1f1b(pp, c.num_microbatches))
register_schedule(
    "interleaved_1f1b",
    Interleaved1F1BConfig,
    lambda c, pp: S.build_interleaved_1f1b(pp, c.num_microbatches, c.stages_per_rank),
)
register_schedule("zb1p", ZB1PConfig, lambda c, pp: S.build_zb1p(pp, c.num_microbatches, c.stages_per_rank))
register_schedule("zbv", ZBVConfig, lambda c, pp: S.build_zbv(pp, c.num_microbatches))
register_schedule(
    "dualpipev", DualPipeVConfig, lambda c, pp: S.build_dualpipev(pp, c.num_microbatches, c.order)
)
register_schedule(
    "inference", InferenceConfig, lambda c, pp: S.build_inference(pp, c.num_microbatches, c.stages_per_rank)
)


def parse_schedule_config(data: Mapping[str, Any] | BaseScheduleConfig) -> BaseScheduleConfig:
    """Build a config from a dict (``{"kind": ..., ...}``) with the class registered for its kind.

    Raises:
        ValueError: an unregistered kind (naming the registered ones); pydantic's ``ValidationError``
            (a ``ValueError``) for the config class's own field errors.
    """
    if isinstance(data, BaseScheduleConfig):
        return data
    if not isinstance(data, Mapping):
        raise ValueError(f"a pipeline schedule config is a mapping with a 'kind', got {type(data).__name__}")
    return _registered(data.get("kind")).config_cls.model_validate(dict(data))


PipelineScheduleConfig = Annotated[
    BaseScheduleConfig,
    PlainValidator(parse_schedule_config, json_schema_input_type=dict[str, Any]),
    PlainSerializer(lambda config: config.model_dump(), return_type=dict[str, Any]),
]
"""A pydantic field type for any registered schedule's config: a dict (or a config) is validated by
the class registered for its ``kind`` (:func:`parse_schedule_config`), a user's kinds included."""


def build_program(config: BaseScheduleConfig | Mapping[str, Any], pp_size: int) -> Program:
    """The compute-only program of `config` on `pp_size` ranks (pass it to ``lower`` for the full one)."""
    cfg = parse_schedule_config(config)
    return _registered(cfg.kind).builder(cfg, pp_size)


def build_pipeline(
    config: BaseScheduleConfig | Mapping[str, Any],
    *,
    pp_group: dist.ProcessGroup | None,
    stage_modules: Mapping[int, nn.Module],
    loss_fn: LossFn | None = None,
    forward_kwargs_fn: ForwardKwargsFn | None = None,
    device: torch.device | str | None = None,
    on_backward: BackwardHook | None = None,
    fsdp_gather_once: bool = False,
) -> PipelineExecutor | OfflineExecutor:
    """Build the executor for `config`: a :class:`PipelineExecutor`, or an :class:`OfflineExecutor` for pp=1.

    Args:
        config: a schedule config or its dict form.
        pp_group: the pipeline process group; None or a group of size 1 means no pipeline parallelism.
        stage_modules: the stages this rank holds (``config.topology(pp).stages_of(pp_rank)``), by global index.
        loss_fn: ``(last_stage_outputs, microbatch_view) -> scalar``; None only for inference.
        forward_kwargs_fn: optional ``(stage, microbatch_view) -> extra keyword tensors``.
        device: activation device (defaults to the stage parameters' device).
        on_backward: called with ``(stage, microbatch)`` when that stage's weight gradients of the
            microbatch are complete.
        fsdp_gather_once: all-gather each FSDP2 module of the stages once per step (see
            :class:`PipelineExecutor`).
    """
    cfg = parse_schedule_config(config)
    pp = 1 if pp_group is None else dist.get_world_size(pp_group)
    if cfg.forward_only and loss_fn is not None:
        raise ValueError(f"the {cfg.kind} schedule runs forward only; pass loss_fn=None")
    if pp == 1:
        return OfflineExecutor(
            stage_modules,
            loss_fn,
            cfg.num_microbatches,
            forward_kwargs_fn=forward_kwargs_fn,
            loss_reduction=cfg.loss_reduction,
            on_backward=on_backward,
            fsdp_gather_once=fsdp_gather_once,
        )
    assert pp_group is not None
    return PipelineExecutor(
        build_program(cfg, pp),
        stage_modules,
        pp_group,
        loss_fn,
        forward_kwargs_fn=forward_kwargs_fn,
        loss_reduction=cfg.loss_reduction,
        device=device,
        on_backward=on_backward,
        fsdp_gather_once=fsdp_gather_once,
    )
