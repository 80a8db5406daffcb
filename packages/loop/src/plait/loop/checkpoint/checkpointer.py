"""Asynchronous, atomic, resumable checkpoints on torch.distributed.checkpoint (DCP).

Follows Megatron-Core's split of a save into phases:

1. **stage**: tensors are copied to (pinned, shared) host memory; training may continue once the
   copy is done (:meth:`Checkpointer.wait_for_staging` guards the next optimizer step).
2. **write**: a background process (or thread) plans and writes the files. DCP's save planner runs
   with plan caching, so while the state's structure is unchanged later saves reuse the cached
   global plan instead of planning again.
3. **finalise**: every rank's write is done, a barrier, then the main rank writes the marker and
   renames ``.step_N.partial`` to ``step_N``: the checkpoint becomes visible atomically. The
   previous save is finalised before the next starts and before exit; :meth:`Checkpointer.poll`
   (called by the trainer after every step) finalises it as soon as every rank's write is done,
   so a checkpoint is complete on disk promptly instead of when the next save starts.

The marker records every file's size (and with ``checksums`` a CRC32); :meth:`Checkpointer.latest`
verifies them and skips a damaged checkpoint, naming it, for the previous complete one.
:meth:`Checkpointer.reserve` allocates the (pinned, shared) staging buffers and starts the
background process ahead of the first save, off the critical path.

:class:`Checkpointer` orchestrates; the phases live in modules of their own: ``staging``,
``writing`` with ``writer_process`` (the background process as an object, passed in or the
process-wide one), ``integrity`` (marker, atomic visibility, file checks), ``rotation`` and
``loading`` (resume). Every use of DCP's private names is in ``dcp_compat``, except the names of
the classes DCP's ``.metadata`` is made of, allowed by ``safe_metadata``.

Loading runs no code of the checkpoint's: non-tensor items are read with
``torch.load(weights_only=True)``, and DCP's ``.metadata`` pickle with ``safe_metadata``'s
restricted unpickler, which builds only the classes DCP metadata is made of (anything else raises
:class:`UnsafeCheckpointError`, handled like a damaged checkpoint).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from plait.loop.checkpoint import _codec, _layout, dcp_compat
from plait.loop.checkpoint.errors import (
    CheckpointDamagedError,
    CheckpointMismatchError,
    CheckpointWriteError,
    UnsafeCheckpointError,
    failure_reason,
)
from plait.loop.checkpoint.group import CheckpointGroup, initialised
from plait.loop.checkpoint.integrity import publish
from plait.loop.checkpoint.loading import SafeLoadPlanner, check_structure, newest_intact
from plait.loop.checkpoint.planning import PLAN_CACHE_KEYS, CachingSavePlanner, plan_file
from plait.loop.checkpoint.rotation import rotate
from plait.loop.checkpoint.safe_metadata import SafeFileSystemReader
from plait.loop.checkpoint.staging import Staging
from plait.loop.checkpoint.state import PerRankState
from plait.loop.checkpoint.writer_process import WRITER_PROCESS, WriterProcess
from plait.loop.checkpoint.writing import write_async, write_now
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import LoadPlanner, SavePlanner
from torch.distributed.checkpoint.storage import StorageWriter

__all__ = [
    "AsyncMode",
    "CheckpointDamagedError",
    "CheckpointMismatchError",
    "CheckpointWriteError",
    "Checkpointer",
    "OnDamaged",
    "UnsafeCheckpointError",
]

log = logging.getLogger(__name__)

AsyncMode = Literal["process", "thread", "off"]
OnDamaged = Literal["fall_back", "stop"]


@dataclass
class _Pending:
    step: int
    path: Path
    response: Any  # Future or AsyncSaveResponse
    started: float


def _expand(state: dict[str, Any]) -> dict[str, Any]:
    return {k: (v.state_dict() if hasattr(v, "state_dict") else v) for k, v in state.items()}


class Checkpointer:
    """Saves and restores the training state under ``root``, keeping the newest ``keep_last``.

    Args:
        root: directory holding ``step_XXXXXXXX`` checkpoints.
        keep_last: how many complete checkpoints to keep (older ones are deleted after a save).
        async_mode: ``"process"`` (write from a background process, the default), ``"thread"``, or
            ``"off"`` (synchronous). Process mode needs an initialised process group; a single
            process without one writes from a thread (logged once).
        process_group: a CPU (gloo) group for DCP's coordination; defaults to the default group,
            which must then have a CPU backend.
        pin_memory: stage into pinned host memory (CUDA only).
        checksums: also record a CRC32 of every file in the marker and verify it in
            :meth:`latest` (reads the checkpoint once more at save and at resume); file sizes are
            always recorded and verified.
        on_damaged: what :meth:`latest` does with a damaged newest checkpoint: ``"fall_back"``
            (warn, naming it, and use the previous complete one) or ``"stop"`` (raise
            :class:`CheckpointDamagedError`).
        save_planner: the DCP save planner (default: a
            :class:`~plait.loop.checkpoint.CachingSavePlanner`, whose cached global plan is saved
            with each checkpoint and reused after a restart). One instance serves every save; a
            ``DefaultSavePlanner`` (or subclass) gets a plan-cache key of its own.
        storage_writer_factory: builds the DCP storage writer of each save from the checkpoint's
            (partial) directory (default: DCP's ``FileSystemWriter``); every save writes a new
            directory, so it is called once per save.
        load_planner: the DCP load planner (default: DCP's planner, except that non-tensor items are
            read with ``torch.load(weights_only=True)``).
        coordinator_rank: the rank (in ``process_group``) that gathers the plans and writes DCP's
            ``.metadata``. torch's ``async_save`` has no such argument, so a rank other than 0 needs
            ``async_mode="off"``.
        writer_process: the background writer process of process mode (default: the process-wide
            :data:`~plait.loop.checkpoint.writer_process.WRITER_PROCESS`); acquired here, released
            by :meth:`close`.

    In process mode the background writer process joins the job's own store (torchrun's
    ``MASTER_ADDR``/``MASTER_PORT``; a one-process job without them gets a store on 127.0.0.1)
    under a prefix instead of opening a store of its own, which would listen on every network
    interface (see :class:`~plait.loop.checkpoint.writer_process.WriterProcess`).
    """

    def __init__(
        self,
        root: str | Path,
        *,
        keep_last: int = 3,
        async_mode: AsyncMode = "process",
        process_group: dist.ProcessGroup | None = None,
        pin_memory: bool | None = None,
        checksums: bool = False,
        on_damaged: OnDamaged = "fall_back",
        save_planner: SavePlanner | None = None,
        storage_writer_factory: Callable[[Path], StorageWriter] | None = None,
        load_planner: LoadPlanner | None = None,
        coordinator_rank: int = 0,
        writer_process: WriterProcess | None = None,
    ) -> None:
        if on_damaged not in ("fall_back", "stop"):
            raise ValueError(f"on_damaged must be 'fall_back' or 'stop', got {on_damaged!r}")
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        if async_mode not in ("process", "thread", "off"):
            raise ValueError(f"async_mode must be 'process', 'thread' or 'off', got {async_mode!r}")
        self.root = Path(root)
        self.keep_last = keep_last
        self.pg = process_group
        self._group = CheckpointGroup(process_group)
        world = self._group.world_size
        if not 0 <= coordinator_rank < world:
            raise ValueError(
                f"checkpoint.coordinator_rank must be in [0, {world}) (the checkpoint group's size), got {coordinator_rank}"
            )
        if coordinator_rank != 0 and async_mode != "off":
            raise ValueError(
                f"checkpoint.coordinator_rank={coordinator_rank} needs checkpoint.async_mode='off' "
                f"(torch's async_save always coordinates from rank 0), got {async_mode!r}"
            )
        self.coordinator_rank = coordinator_rank
        self._writer_factory = storage_writer_factory
        self._load_planner = load_planner
        if async_mode == "process" and not initialised():
            log.info("no process group: checkpoints are written from a background thread, not a process")
            async_mode = "thread"
        self.async_mode: AsyncMode = async_mode
        self.checksums = checksums
        self.on_damaged: OnDamaged = on_damaged
        self._writer_process: WriterProcess | None = None  # acquired until close()
        if async_mode == "process":
            writer_process = WRITER_PROCESS if writer_process is None else writer_process
            writer_process.acquire(world)
            self._writer_process = writer_process
        # DCP's writes coordinate through collectives; a background thread must not interleave them
        # with the training thread's collectives on the same group, so it gets a group of its own.
        self._dcp_pg = process_group
        if async_mode == "thread" and initialised():
            ranks = dist.get_process_group_ranks(process_group) if process_group is not None else None
            self._dcp_pg = dist.new_group(ranks=ranks, backend="gloo")  # type: ignore[assignment]
        pin = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.staging: Staging | None = None
        if async_mode != "off":
            self.staging = Staging(pin_memory=pin, shared_memory=async_mode == "process")
        # One planner for the run: with plan caching, a save whose structure matches the previous
        # one skips building the global plan. DCP keys its (process-wide) cache by the planner's
        # class name, so two Checkpointers in one process would mix their plans (a checkpoint of
        # one state planned with another's chunks): each gets a key of its own.
        self._planner = CachingSavePlanner() if save_planner is None else save_planner
        if isinstance(self._planner, DefaultSavePlanner):
            PLAN_CACHE_KEYS.assign(self._planner)
        self._pending: _Pending | None = None
        self.last_stall_s = 0.0
        self.last_saved_s: float | None = None  # a save's start to complete, seconds
        self.last_complete: Path | None = None  # the newest checkpoint this Checkpointer completed

    # -- helpers -------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        """This process's rank in the checkpoint's process group."""
        return self._group.rank

    # -- saving ----------------------------------------------------------------------------------
    def save(
        self, step: int, state: dict[str, Any], *, blocking: bool = False, meta: dict | None = None
    ) -> None:
        """Start saving ``state`` (a dict of Stateful objects and values) as checkpoint ``step``.

        The previous save is finalised first. With ``blocking`` (or ``async_mode="off"``) the
        checkpoint is complete and visible when this returns.
        """
        self.finalize()
        t0 = time.perf_counter()
        if self.staging is not None:
            # A save before any step_done(): reserve now, so that the writer process starts under a store
            # namespace of its own (started by DCP itself, a second writer of this process would read the
            # first one's address in the store and fail to connect to it).
            if not self.staging.reserved:
                self.reserve(state)
            self.staging.wait_reserved()
        path = _layout.partial_dir(self.root, step)
        if self.rank == 0:
            _layout.remove(path)
            path.mkdir(parents=True, exist_ok=True)
        self._group.barrier()
        self._meta = {
            "step": step,
            "world_size": self._group.world_size,
            **(meta or {}),
        }
        writer = self._writer_factory(path) if self._writer_factory is not None else None
        if isinstance(self._planner, CachingSavePlanner):
            self._planner.plan_file = str(path / plan_file(self.rank))
        if self.async_mode == "off" or blocking:
            try:
                write_now(
                    state,
                    path,
                    writer,
                    planner=self._planner,
                    process_group=self.pg,
                    coordinator_rank=self.coordinator_rank,
                    no_dist=not initialised(),
                )
            except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
                self._write_failed(step, path, e)
            self._pending = _Pending(step, path, None, t0)
            self.finalize()
        else:
            response = write_async(
                state,
                path,
                writer,
                planner=self._planner,
                process_group=self._dcp_pg,
                in_process=self.async_mode == "process",
                stager=self.staging.stager if self.staging is not None else None,
            )
            self._pending = _Pending(step, path, response, t0)
        self.last_stall_s = time.perf_counter() - t0

    def reserve(self, state: dict[str, Any]) -> None:
        """Prepare the first async save off the critical path: in a background thread, allocate the
        (pinned, shared) host buffers of every tensor in ``state`` and, in process mode, start the
        writer process. The next :meth:`save` waits for this to finish (no stall if it has).

        Call it once the state has its final structure (after the first optimizer step, which
        creates the optimizer's moments). A no-op with ``async_mode="off"``.
        """
        if self.staging is None or self.staging.reserved:
            return
        flat = dcp_compat.flatten(_expand(state))
        tensors = [v for v in flat.values() if isinstance(v, torch.Tensor)]
        start_process = None
        if self._writer_process is not None:  # a collective: here, on every rank
            start_process = self._writer_process.prepare_start(self._dcp_pg)
        self.staging.reserve(tensors, start_process)

    def poll(self) -> Path | None:
        """Finalise the pending save if every rank's write is done (does not wait for it).

        A collective over ``process_group`` while a save is pending; call it on every rank at the
        same point (the trainer calls it after every step). Returns the path it made visible.
        """
        if self._pending is None:
            return None
        response = self._pending.response
        done = response is None or getattr(response, "upload_completion", response).done()
        return None if self._group.any(not done) else self.finalize()

    def step_done(self, state: Callable[[], dict[str, Any]]) -> None:
        """Call on every rank after every training step: the first call reserves the staging buffers
        for ``state()`` (:meth:`reserve`), every call finalises a finished save (:meth:`poll`)."""
        if self.staging is not None and not self.staging.reserved:
            self.reserve(state())
        self.poll()

    def wait_for_staging(self) -> None:
        """Block until the pending save has copied the tensors out; call before mutating them."""
        Staging.wait_copied(self._pending.response if self._pending else None)

    def finalize(self) -> Path | None:
        """Wait for the pending save on every rank and make it visible; returns its final path."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        response = pending.response
        if response is not None:
            future: Future = getattr(response, "upload_completion", response)
            try:
                future.result()
            except (Exception, CheckpointException) as e:
                self._write_failed(pending.step, pending.path, e)
        if isinstance(self._planner, CachingSavePlanner):  # the planning process has taken them
            self._planner.restored = None
        self._group.barrier()
        final = _layout.final_dir(self.root, pending.step)
        self.last_saved_s = time.perf_counter() - pending.started
        if self.rank == 0:
            meta = {**self._meta, "saved_s": round(self.last_saved_s, 3)}
            publish(pending.path, final, meta, checksums=self.checksums)
            rotate(self.root, self.keep_last)
        self._group.barrier()
        log.info(
            "checkpoint step %d complete at %s (%.2f s after the save started)",
            pending.step,
            final,
            self.last_saved_s,
        )
        self.last_complete = final
        return final

    def _write_failed(self, step: int, path: Path, error: BaseException) -> None:
        """Remove what the failed save of ``step`` wrote (freeing the space a full disk needs) and
        raise one :class:`CheckpointWriteError` that says which checkpoint, where, why and what was kept."""
        reason = failure_reason(error, self.root)
        if self.rank == 0:
            _layout.remove(path)
        kept = _layout.list_complete(self.root)
        raise CheckpointWriteError(
            f"checkpoint step {step} could not be written to {path}: {reason}; the partial checkpoint was "
            "removed; "
            + (
                f"the newest complete checkpoint, {kept[-1].path}, is kept"
                if kept
                else "no complete checkpoint exists"
            )
        ) from None

    def close(self) -> None:
        """Finalise any pending save and release the staging buffers."""
        self.finalize()
        if self.staging is not None:
            self.staging.close()
        PLAN_CACHE_KEYS.drop(self._planner)
        if self._writer_process is not None:
            writer_process, self._writer_process = self._writer_process, None
            writer_process.release()

    # -- resuming --------------------------------------------------------------------------------
    def latest(self, *, clean: bool = True, exclude: frozenset[Path] = frozenset()) -> Path | None:
        """The newest complete, intact checkpoint (same answer on every rank).

        Incomplete ones are reported and, with ``clean``, deleted by the main rank. A damaged one
        (a file missing, of the wrong size or, with ``checksums``, the wrong CRC32, or a marker that
        lists no files) is named in a warning and the previous one is tried, or with
        ``on_damaged="stop"`` raises :class:`CheckpointDamagedError`.
        """
        path = None
        if self.rank == 0:
            for bad in _layout.list_incomplete(self.root):
                log.warning("ignoring incomplete checkpoint %s%s", bad, " (deleting it)" if clean else "")
                if clean:
                    _layout.remove(bad)
            path = newest_intact(
                self.root, exclude, checksums=self.checksums, stop_on_damaged=self.on_damaged == "stop"
            )
        path = self._group.broadcast(path)
        if isinstance(path, BaseException):
            raise path
        return Path(path) if path else None

    def resume(
        self, state: dict[str, Any], *, check: Callable[[Path, dict], None] | None = None
    ) -> tuple[Path, dict] | None:
        """Load the newest intact checkpoint into ``state``; returns its path and marker metadata.

        A checkpoint that fails to load on any rank (corrupt data, a per-rank state that is not
        plait's format, a ``.metadata`` refused as :class:`UnsafeCheckpointError`) is handled like a
        damaged one (see :meth:`latest`): named in a warning and the previous one tried, or with
        ``on_damaged="stop"`` raised. None when there is none.
        ``check(path, marker metadata)``, when given, runs before the checkpoint is loaded; what it
        raises stops the resume.
        """
        tried: frozenset[Path] = frozenset()
        while (path := self.latest(exclude=tried)) is not None:
            if check is not None:
                check(path, json.loads((path / _layout.MARKER).read_text()))
            error: CheckpointDamagedError | None = None
            try:
                meta = self.load(path, state)
            except CheckpointDamagedError as e:
                error = e
            if not self._group.any(error is not None):
                return path, meta
            error = error or CheckpointDamagedError(f"checkpoint {path} failed to load on another rank")
            if self.on_damaged == "stop":
                raise error
            log.warning("%s; falling back to the previous complete checkpoint", error)
            tried |= {path}
        return None

    def load(self, path: str | Path, state: dict[str, Any], *, strict: bool = True) -> dict:
        """Restore ``state`` in place from checkpoint ``path``; returns the checkpoint's marker metadata.

        The checkpoint's structure is checked against ``state`` first: missing keys, shape
        mismatches and (with ``strict``) keys that no rank's state has (a pipeline stage holds its part) raise
        :class:`CheckpointMismatchError` naming them. Per-rank states (RNG, metric accumulators) of ranks that did not exist
        when the checkpoint was saved (a different world size) are skipped with a warning.
        """
        path = Path(path)
        marker = path / _layout.MARKER
        if not marker.is_file():
            raise CheckpointMismatchError(f"{path} is not a complete plait checkpoint (no {_layout.MARKER})")
        meta = json.loads(marker.read_text())
        try:
            saved = SafeFileSystemReader(str(path)).read_metadata().state_dict_metadata
        except CheckpointDamagedError:  # an UnsafeCheckpointError: resume falls back or stops
            raise
        except Exception as e:
            raise CheckpointMismatchError(f"cannot read checkpoint metadata in {path}: {e}") from e
        state = dict(state)
        for key, value in list(state.items()):
            if isinstance(value, PerRankState) and not any(
                k.startswith(f"{key}.rank{self.rank}") for k in saved
            ):
                log.warning(
                    "checkpoint %s has no %r state for rank %d (saved with world size %s); "
                    "keeping this rank's current one",
                    path,
                    key,
                    self.rank,
                    meta.get("world_size"),
                )
                del state[key]
        # Expand each Stateful once: the same dicts are checked, loaded into in place, then handed back
        # (what dcp.load does itself, which would call every state_dict() a second time).
        expanded = _expand(state)
        check_structure(
            path,
            saved,
            dcp_compat.flatten(expanded),
            strict=strict,
            rank_keyed=[k for k, v in state.items() if isinstance(v, PerRankState)],
            group=self._group,
        )
        try:
            dcp_compat.load_state_dict(
                expanded,
                SafeFileSystemReader(str(path)),
                process_group=self.pg,
                coordinator_rank=self.coordinator_rank,
                no_dist=not initialised(),
                planner=self._load_planner if self._load_planner is not None else SafeLoadPlanner(),
            )
        except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
            raise CheckpointDamagedError(
                f"checkpoint {path} cannot be read: {type(e).__name__}: {str(e).strip()[-2000:]}"
            ) from e
        self._restore_plan(path, saved)
        for k, v in state.items():
            if hasattr(v, "load_state_dict"):
                try:
                    v.load_state_dict(expanded[k])
                except _codec.StateFormatError as e:
                    raise CheckpointDamagedError(f"checkpoint {path}: {k!r}: {e}") from e
        return meta

    def _restore_plan(self, path: Path, saved: dict) -> None:
        """Start the next save from the save plan cached with checkpoint ``path``, where every rank's
        plan file matches the checkpoint's metadata ``saved`` (a collective)."""
        planner = self._planner
        if not isinstance(planner, CachingSavePlanner):
            return
        problem = planner.restore(
            path / plan_file(self.rank),
            saved,
            world_size=self._group.world_size,
            is_coordinator=self.rank == self.coordinator_rank,
        )
        if self._group.any(problem is not None):
            planner.restored = None
            log.info(
                "not reusing the save plan of %s (%s): the next save plans again",
                path,
                problem or "another rank's plan does not match",
            )
        else:
            log.info("reusing the save plan of %s while the state's structure is unchanged", path)
