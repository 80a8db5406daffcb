"""Operations: determinism and the seed, profiling windows, GC control, collective timeouts, mesh-prefixed logs."""

from plait.loop.ops.determinism import apply_determinism
from plait.loop.ops.gc_control import GCController
from plait.loop.ops.logs import mesh_prefix, setup_logging
from plait.loop.ops.profiling import StepProfiler
from plait.loop.ops.timeouts import set_collective_timeout

__all__ = [
    "GCController",
    "StepProfiler",
    "apply_determinism",
    "mesh_prefix",
    "set_collective_timeout",
    "setup_logging",
]
