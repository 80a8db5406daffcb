"""plait.pipelining: pipeline-parallel schedule IR, program builders (GPipe to DualPipeV), validator,
simulator and executor with split backward."""

from plait.pipelining.actions import Action, ActionKind, AnyAction, CommGroup, OverlapAction, parse_action
from plait.pipelining.config import (
    BaseScheduleConfig,
    DualPipeVConfig,
    GPipeConfig,
    InferenceConfig,
    Interleaved1F1BConfig,
    LoopedBFSConfig,
    LoopedScheduleConfig,
    OneFOneBConfig,
    PipelineScheduleConfig,
    ZB1PConfig,
    ZBVConfig,
    build_pipeline,
    build_program,
    parse_schedule_config,
    register_schedule,
    registered_schedules,
)
from plait.pipelining.executor import (
    OfflineExecutor,
    PipelineExecutor,
    PipelineStepResult,
    build_forward_program,
)
from plait.pipelining.fsdp import GradientSync
from plait.pipelining.lowering import lower
from plait.pipelining.p2p import P2PLink
from plait.pipelining.program import Program, parse_program
from plait.pipelining.runner import BackwardHook, ForwardKwargsFn, LossFn, StageRunner
from plait.pipelining.schedules import (
    build_1f1b,
    build_dualpipev,
    build_gpipe,
    build_inference,
    build_interleaved_1f1b,
    build_looped_bfs,
    build_zb1p,
    build_zbv,
)
from plait.pipelining.simulator import ActionCosts, SimulationResult, TimelineEntry, simulate
from plait.pipelining.split_backward import WeightGradWork, backward_input, backward_weight
from plait.pipelining.state import Chunk, MicrobatchSpec, MicrobatchView, PipelineState, Shared, Stack
from plait.pipelining.topology import StageTopology, loop_topology, vshape_topology
from plait.pipelining.validation import ProgramError, dry_run, validate

__all__ = [
    "Action",
    "ActionCosts",
    "ActionKind",
    "AnyAction",
    "BackwardHook",
    "BaseScheduleConfig",
    "Chunk",
    "CommGroup",
    "DualPipeVConfig",
    "ForwardKwargsFn",
    "GPipeConfig",
    "GradientSync",
    "InferenceConfig",
    "Interleaved1F1BConfig",
    "LoopedBFSConfig",
    "LoopedScheduleConfig",
    "LossFn",
    "MicrobatchSpec",
    "MicrobatchView",
    "OfflineExecutor",
    "OneFOneBConfig",
    "OverlapAction",
    "P2PLink",
    "PipelineExecutor",
    "PipelineScheduleConfig",
    "PipelineState",
    "PipelineStepResult",
    "Program",
    "ProgramError",
    "Shared",
    "SimulationResult",
    "Stack",
    "StageRunner",
    "StageTopology",
    "TimelineEntry",
    "WeightGradWork",
    "ZB1PConfig",
    "ZBVConfig",
    "backward_input",
    "backward_weight",
    "build_1f1b",
    "build_dualpipev",
    "build_forward_program",
    "build_gpipe",
    "build_inference",
    "build_interleaved_1f1b",
    "build_looped_bfs",
    "build_pipeline",
    "build_program",
    "build_zb1p",
    "build_zbv",
    "dry_run",
    "loop_topology",
    "lower",
    "parse_action",
    "parse_program",
    "parse_schedule_config",
    "register_schedule",
    "registered_schedules",
    "simulate",
    "validate",
    "vshape_topology",
]
