"""Runs that heal themselves: a heartbeat file, stragglers in the metrics, and a step watchdog.

- :class:`Heartbeat`: the main rank keeps ``<run_dir>/heartbeat.json`` (step, time, tokens, phase)
  fresh for a watchdog outside the job.
- :class:`StragglerMeter`: each logging interval, the slowest rank and its lag over the median.
- :class:`StepWatchdog`: a rank whose loop stalls prints its phase, the ranks it waits for and the
  collective it waits in (:mod:`~plait.loop.resilience.diagnosis`: the ranks' :class:`ProgressBeacon`
  in the default group's store, :func:`find_collective` on its Python stack), its stacks, dumps the NCCL
  flight recorder, and exits with :data:`WATCHDOG_EXIT_CODE` (75) so that torchrun or Slurm restart the
  job, which resumes from its last complete checkpoint.

The :class:`~plait.loop.Trainer` builds all three from ``logging`` and ``timeouts.watchdog``.
"""

from plait.loop.resilience.diagnosis import CollectiveWait, ProgressBeacon, find_collective
from plait.loop.resilience.flight_recorder import dump_nccl_flight_recorder
from plait.loop.resilience.heartbeat import HEARTBEAT_FILE, Heartbeat
from plait.loop.resilience.stragglers import (
    RANK_DELAY_ENV,
    RANK_HANG_ENV,
    RankHang,
    StragglerMeter,
    StragglerReport,
    find_straggler,
    rank_delay_from_env,
    rank_hang_from_env,
)
from plait.loop.resilience.watchdog import (
    WATCHDOG_EXIT_CODE,
    StepWatchdog,
    restart_store_warning,
    watchdog_enabled,
)

__all__ = [
    "HEARTBEAT_FILE",
    "RANK_DELAY_ENV",
    "RANK_HANG_ENV",
    "WATCHDOG_EXIT_CODE",
    "CollectiveWait",
    "Heartbeat",
    "ProgressBeacon",
    "RankHang",
    "StepWatchdog",
    "StragglerMeter",
    "StragglerReport",
    "dump_nccl_flight_recorder",
    "find_collective",
    "find_straggler",
    "rank_delay_from_env",
    "rank_hang_from_env",
    "restart_store_warning",
    "watchdog_enabled",
]
