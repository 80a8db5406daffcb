"""Async, atomic, resumable checkpoints of the whole training state (DCP underneath)."""

from plait.loop.checkpoint.checkpointer import (
    AsyncMode,
    CheckpointDamagedError,
    Checkpointer,
    CheckpointMismatchError,
    CheckpointWriteError,
    OnDamaged,
    UnsafeCheckpointError,
)
from plait.loop.checkpoint.export import export_checkpoint, find_checkpoint
from plait.loop.checkpoint.planning import CachingSavePlanner
from plait.loop.checkpoint.preemption import PreemptionHandler
from plait.loop.checkpoint.resume_policy import ResumeConfigError
from plait.loop.checkpoint.state import ModelState, OptimizerState, PerRankState, RngState, ValueState
from plait.loop.checkpoint.training import TrainingCheckpoints
from plait.loop.checkpoint.writer_process import WriterProcess

__all__ = [
    "AsyncMode",
    "CachingSavePlanner",
    "CheckpointDamagedError",
    "CheckpointMismatchError",
    "CheckpointWriteError",
    "Checkpointer",
    "ModelState",
    "OnDamaged",
    "OptimizerState",
    "PerRankState",
    "PreemptionHandler",
    "ResumeConfigError",
    "RngState",
    "TrainingCheckpoints",
    "UnsafeCheckpointError",
    "ValueState",
    "WriterProcess",
    "export_checkpoint",
    "find_checkpoint",
]
