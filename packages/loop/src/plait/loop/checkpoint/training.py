"""The checkpoints of a training run: a :class:`Checkpointer` set up from the ``checkpoint`` config section."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist
from plait.loop.checkpoint.checkpointer import Checkpointer
from plait.loop.checkpoint.preemption import PreemptionHandler
from plait.loop.checkpoint.resume_policy import check_resume_config
from plait.loop.config import TrainerConfig
from plait.loop.events import EventBus, StepEnd
from torch.distributed.checkpoint import LoadPlanner, SavePlanner, StorageWriter

__all__ = ["TrainingCheckpoints"]

log = logging.getLogger("plait.loop")


class TrainingCheckpoints:
    """When a training run saves, and how it resumes and stops on a signal, around a :class:`Checkpointer`.

    Saves every ``checkpoint.interval`` steps and at the last step (:meth:`due`, :meth:`save`); after every
    step (the run's :class:`~plait.loop.StepEnd`) the checkpointer finalises a finished save and, after
    the first, reserves its staging buffers (:meth:`Checkpointer.step_done`).

    Args:
        config: the run's configuration: its ``checkpoint`` section (used when ``enabled``); checkpoints
            go to ``checkpoint.dir``, by default ``<run.run_dir>/checkpoints``, their markers record
            ``run.name``.
        state: returns the whole training state (``Trainer.app_state``), saved and resumed.
        events: the run's event bus.
        process_group: a CPU group over all ranks for DCP's coordination and the stop-signal
            agreement (None: the default group, or a single process).
        save_planner, storage_writer_factory, load_planner: DCP hooks passed to the
            :class:`Checkpointer` (see there).
    """

    def __init__(
        self,
        config: TrainerConfig,
        state: Callable[[], dict[str, Any]],
        events: EventBus,
        *,
        process_group: dist.ProcessGroup | None = None,
        save_planner: SavePlanner | None = None,
        storage_writer_factory: Callable[[Path], StorageWriter] | None = None,
        load_planner: LoadPlanner | None = None,
    ) -> None:
        self.settings = ck = config.checkpoint
        self.config = config
        self.state = state
        self.process_group = process_group
        self.meta = {"run": config.run.name, "config": config.model_dump(mode="json")}
        self.checkpointer = checkpointer = Checkpointer(
            Path(ck.dir) if ck.dir else Path(config.run.run_dir) / "checkpoints",
            keep_last=ck.keep_last,
            async_mode=ck.async_mode,
            process_group=process_group,
            checksums=ck.checksums,
            on_damaged=ck.on_damaged,
            coordinator_rank=ck.coordinator_rank,
            save_planner=save_planner,
            storage_writer_factory=storage_writer_factory,
            load_planner=load_planner,
        )
        events.subscribe(StepEnd, lambda e: checkpointer.step_done(state))

    def resume(self) -> tuple[Path, dict] | None:
        """With ``checkpoint.resume``, load the newest intact checkpoint into the state (see
        :meth:`Checkpointer.resume`) and log it; its path and marker metadata, or None when none was loaded.

        The config the checkpoint was saved with is compared with the run's
        (:func:`~plait.loop.checkpoint.resume_policy.check_resume_config`): each change is logged.

        Raises:
            ResumeConfigError: a change of a field in the config's ``fixed_on_resume``, or a checkpoint
                past ``run.steps``.
        """
        if not self.settings.resume:
            return None
        cfg = self.config
        current = cfg.model_dump(mode="json")

        def check(path: Path, meta: dict) -> None:
            check_resume_config(path, meta, current, cfg.fixed_on_resume, cfg.run.steps)

        resumed = self.checkpointer.resume(self.state(), check=check)
        if resumed is not None:
            path, meta = resumed
            log.info(
                "resumed from %s (step %s, saved by %s ranks)", path, meta.get("step"), meta.get("world_size")
            )
        return resumed

    def due(self, step: int, *, last: bool) -> bool:
        """Whether to save after step ``step``: at the ``last`` step of the run, and every ``interval`` steps."""
        return last or (self.settings.interval is not None and step % self.settings.interval == 0)

    def save(self, step: int, *, blocking: bool = False) -> None:
        """Save the state as checkpoint ``step`` (asynchronously unless ``blocking``)."""
        self.checkpointer.save(step, self.state(), blocking=blocking, meta=self.meta)

    def preemption_handler(self) -> PreemptionHandler | None:
        """A new SIGTERM/SIGINT handler for one training run (``checkpoint.save_on_signal``; None without it).

        Call its ``restore()`` when the run ends.
        """
        if not self.settings.save_on_signal:
            return None
        return PreemptionHandler(self.settings.grace_period_s, self.process_group)

    def close(self) -> None:
        """Finish the pending save (see :meth:`Checkpointer.close`)."""
        self.checkpointer.close()
