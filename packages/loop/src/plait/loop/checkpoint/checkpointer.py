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

Loading never unpickles plait's own values: non-tensor items are read with
``torch.load(weights_only=True)``. DCP's ``.metadata`` file itself is a pickle, so only load
checkpoints you trust.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import socket
import threading
import time
import weakref
import zlib
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from plait.loop.checkpoint import _codec, _layout
from plait.loop.checkpoint.planning import CachingSavePlanner, plan_file
from plait.loop.checkpoint.state import PerRankState
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner, FileSystemReader
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint._state_dict_stager import StateDictStager
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlanner, SavePlanner
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
from torch.distributed.checkpoint.state_dict_saver import (
    AsyncCheckpointerType,
    _save_state_dict,
    _stateful_to_state_dict,
)
from torch.distributed.checkpoint.storage import StorageWriter

log = logging.getLogger(__name__)

AsyncMode = Literal["process", "thread", "off"]
_PLAN_KEYS = itertools.count()
_PLAN_CACHES = (
    "_cached_save_plan",
    "_cached_final_save_plan",
    "_cached_all_plans",
    "_cached_global_plan",
    "_cached_metadata",
)
OnDamaged = Literal["fall_back", "stop"]


class CheckpointMismatchError(RuntimeError):
    """The checkpoint on disk does not fit the state it is loaded into; the message lists what differs."""


class CheckpointDamagedError(RuntimeError):
    """A checkpoint's files are missing, truncated or corrupt, or hold data plait will not load;
    the message names the checkpoint and the file."""


@dataclass
class _Pending:
    step: int
    path: Path
    response: Any  # Future or AsyncSaveResponse
    started: float


class _KeepBuffers(StateDictStager):
    """A StateDictStager whose pinned host buffers live as long as the Checkpointer, not one save.

    torch 2.10/2.11's DefaultStager closes its StateDictStager after every stage. That drops the cached
    host buffers and empties the copy-dispatch table, so the second save fails with
    ``KeyError: <class 'type'>`` (and every save would allocate and pin the whole state again).
    Later torch no longer closes it; either way the Checkpointer releases the buffers in ``close()``.
    """

    def close(self) -> None:  # what DefaultStager calls after each stage on torch <= 2.11
        pass

    def release(self) -> None:
        super().close()

    def reserve(self, tensors: list[torch.Tensor]) -> None:
        """Allocate (share, pin) the host buffer of each tensor's storage now, without copying.

        The same buffers the first :meth:`stage` would allocate, in the same cache, so that the
        first save only copies.
        """
        import torch.cuda._pin_memory_utils as pin_memory_utils
        from torch.distributed.tensor import DTensor

        for t in tensors:
            local = t._local_tensor if isinstance(t, DTensor) else t
            if local.device.type == "meta" or local.data_ptr() == 0:
                continue
            storage = local.untyped_storage()
            if storage in self._cached_storage_mapping:
                continue
            kind = type(storage)
            host = (
                kind._new_shared(storage.size(), device="cpu") if self.share_memory else kind(storage.size())
            )
            if self.pin_memory and host.nbytes() >= self.pin_memory_min_bytes:
                pin_memory_utils.pin_memory(host.data_ptr(), host.nbytes())
                weakref.finalize(host, pin_memory_utils.unpin_memory, host.data_ptr()).atexit = False
            self._cached_storage_mapping[storage] = host


class _Stager(DefaultStager):
    """DefaultStager (pinned/shared host copies in a background thread) that reuses its buffers."""

    def __init__(self, options: StagingOptions) -> None:
        super().__init__(options)
        self._state_dict_stager: _KeepBuffers = _KeepBuffers(
            pin_memory=options.use_pinned_memory, share_memory=options.use_shared_memory
        )

    def close(self) -> None:
        super().close()
        self._state_dict_stager.release()


def _initialised() -> bool:
    return dist.is_available() and dist.is_initialized()


def _flatten(expanded: dict[str, Any]) -> dict[str, Any]:
    """Flatten a state dict whose Stateful objects are expanded the way DCP does (nested keys joined by '.')."""
    flat, _ = flatten_state_dict(expanded)
    return flat


def _expand(state: dict[str, Any]) -> dict[str, Any]:
    return {k: (v.state_dict() if hasattr(v, "state_dict") else v) for k, v in state.items()}


class _SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, except that non-tensor items load with ``torch.load(weights_only=True)``
    (plain data and tensors only; DCP's own planner unpickles them without restriction)."""

    def load_bytes(self, read_item: Any, value: Any) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def _file_record(path: Path, checksum: bool) -> dict[str, int]:
    record = {"size": path.stat().st_size}
    if checksum:
        crc = 0
        with path.open("rb") as f:
            while chunk := f.read(1 << 24):
                crc = zlib.crc32(chunk, crc)
        record["crc32"] = crc
    return record


def _damage(path: Path, meta: dict, *, checksums: bool = True) -> str | None:
    """What is wrong with the files of checkpoint ``path`` against its marker ``meta``, or None.

    Checks that every file the marker lists exists with its recorded size, and (with
    ``checksums``, where the marker has them) its CRC32. A marker without a file list (written
    before plait recorded one) is not checked.
    """
    for name, want in (meta.get("files") or {}).items():
        f = path / name
        if not f.is_file():
            return f"file {name} is missing"
        size = f.stat().st_size
        if size != want.get("size"):
            return f"file {name} has {size} bytes, the marker recorded {want.get('size')} (truncated or overwritten)"
        if checksums and "crc32" in want and _file_record(f, True)["crc32"] != want["crc32"]:
            return f"file {name} does not match its recorded CRC32 (corrupt)"
    return None


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

    In process mode the background writer process joins the job's own store (torchrun's
    ``MASTER_ADDR``/``MASTER_PORT``; a one-process job without them gets a store on 127.0.0.1)
    under a prefix instead of opening a store of its own, which would listen on every network
    interface.
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
        world = dist.get_world_size(process_group) if _initialised() else 1
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
        if async_mode == "process" and not _initialised():
            log.info("no process group: checkpoints are written from a background thread, not a process")
            async_mode = "thread"
        self.async_mode: AsyncMode = async_mode
        self.checksums = checksums
        self.on_damaged: OnDamaged = on_damaged
        self._holds_writer = async_mode == "process"  # counted in _OPEN_WRITERS until close()
        if async_mode == "process":
            _join_job_store(dist.get_world_size(process_group))
            _quiet_writer_process()
            global _OPEN_WRITERS
            _OPEN_WRITERS += 1
        # DCP's writes coordinate through collectives; a background thread must not interleave them
        # with the training thread's collectives on the same group, so it gets a group of its own.
        self._dcp_pg = process_group
        if async_mode == "thread" and _initialised():
            ranks = dist.get_process_group_ranks(process_group) if process_group is not None else None
            self._dcp_pg = dist.new_group(ranks=ranks, backend="gloo")  # type: ignore[assignment]
        pin = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._stager: _Stager | None = None
        if async_mode != "off":
            self._stager = _Stager(
                StagingOptions(
                    use_pinned_memory=pin,
                    use_shared_memory=async_mode == "process",
                    use_async_staging=True,
                    use_non_blocking_copy=pin,
                )
            )
        # One planner for the run: with plan caching, a save whose structure matches the previous
        # one skips building the global plan. DCP keys its (process-wide) cache by the planner's
        # class name, so two Checkpointers in one process would mix their plans (a checkpoint of
        # one state planned with another's chunks): each gets a key of its own.
        self._planner = CachingSavePlanner() if save_planner is None else save_planner
        if isinstance(self._planner, DefaultSavePlanner):
            self._planner._cached_plans_key = f"plait.Checkpointer/{next(_PLAN_KEYS)}"
        self._pending: _Pending | None = None
        self._reserving: threading.Thread | None = None
        self._reserve_error: BaseException | None = None
        self.last_stall_s = 0.0
        self.last_saved_s: float | None = None  # a save's start to complete, seconds
        self.last_complete: Path | None = None  # the newest checkpoint this Checkpointer completed

    # -- helpers -------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return dist.get_rank(self.pg) if _initialised() else 0

    def _barrier(self) -> None:
        if _initialised():
            dist.barrier(group=self.pg)

    def _broadcast(self, obj: Any) -> Any:
        if not _initialised():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.pg, 0) if self.pg else 0, group=self.pg)
        return box[0]

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
        self._wait_reserved()
        path = _layout.partial_dir(self.root, step)
        if self.rank == 0:
            _layout.remove(path)
            path.mkdir(parents=True, exist_ok=True)
        self._barrier()
        self._meta = {
            "step": step,
            "world_size": dist.get_world_size(self.pg) if _initialised() else 1,
            **(meta or {}),
        }
        writer = self._writer_factory(path) if self._writer_factory is not None else None
        if isinstance(self._planner, CachingSavePlanner):
            self._planner.plan_file = str(path / plan_file(self.rank))
        if self.async_mode == "off" or blocking:
            # DCP's internal save: the public dcp.save has no coordinator_rank
            _save_state_dict(
                state_dict=_stateful_to_state_dict(state),
                storage_writer=writer if writer is not None else dcp.FileSystemWriter(str(path)),
                process_group=self.pg,
                coordinator_rank=self.coordinator_rank,
                no_dist=not _initialised(),
                planner=self._planner,
            )
            self._pending = _Pending(step, path, None, t0)
            self.finalize()
        else:
            response = dcp.async_save(
                state,
                checkpoint_id=str(path),
                storage_writer=writer,
                planner=self._planner,
                process_group=self._dcp_pg,
                async_checkpointer_type=AsyncCheckpointerType.PROCESS
                if self.async_mode == "process"
                else AsyncCheckpointerType.THREAD,
                async_stager=self._stager,
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
        if self._stager is None or self._reserving is not None:
            return
        flat = _flatten(_expand(state))
        tensors = [v for v in flat.values() if isinstance(v, torch.Tensor)]
        start_process = None
        if self.async_mode == "process":
            from torch.distributed.checkpoint import _async_process_executor as ape

            if ape._CHECKPOINT_PROCESS is None:
                info = ape._ProcessGroupInitInfo(self._dcp_pg)  # a collective: here, on every rank

                def start_process() -> None:
                    ape._CHECKPOINT_PROCESS = ape._AsyncCheckpointProcess(info)

        stager = self._stager._state_dict_stager

        def work() -> None:
            try:
                if start_process is not None:
                    start_process()
                stager.reserve(tensors)
            except BaseException as e:  # re-raised by the next save
                self._reserve_error = e

        self._reserving = threading.Thread(target=work, name="plait-checkpoint-reserve", daemon=True)
        self._reserving.start()

    def _wait_reserved(self) -> None:
        if self._reserving is not None:
            self._reserving.join()
        if self._reserve_error is not None:
            err, self._reserve_error = self._reserve_error, None
            raise RuntimeError(f"preparing the checkpoint staging buffers failed: {err}") from err

    def poll(self) -> Path | None:
        """Finalise the pending save if every rank's write is done (does not wait for it).

        A collective over ``process_group`` while a save is pending; call it on every rank at the
        same point (the trainer calls it after every step). Returns the path it made visible.
        """
        if self._pending is None:
            return None
        response = self._pending.response
        done = response is None or getattr(response, "upload_completion", response).done()
        return None if self._any(not done) else self.finalize()

    def step_done(self, state: Callable[[], dict[str, Any]]) -> None:
        """Call on every rank after every training step: the first call reserves the staging buffers
        for ``state()`` (:meth:`reserve`), every call finalises a finished save (:meth:`poll`)."""
        if self._reserving is None:
            self.reserve(state())
        self.poll()

    def wait_for_staging(self) -> None:
        """Block until the pending save has copied the tensors out; call before mutating them."""
        response = self._pending.response if self._pending else None
        if response is not None and hasattr(response, "staging_completion"):
            response.staging_completion.result()

    def finalize(self) -> Path | None:
        """Wait for the pending save on every rank and make it visible; returns its final path."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        response = pending.response
        if response is not None:
            future: Future = getattr(response, "upload_completion", response)
            future.result()
        if isinstance(self._planner, CachingSavePlanner):  # the planning process has taken them
            self._planner.restored = None
        self._barrier()
        final = _layout.final_dir(self.root, pending.step)
        self.last_saved_s = time.perf_counter() - pending.started
        if self.rank == 0:
            files = {
                f.name: _file_record(f, self.checksums) for f in sorted(pending.path.iterdir()) if f.is_file()
            }
            marker = pending.path / _layout.MARKER
            marker.write_text(
                json.dumps({**self._meta, "saved_s": round(self.last_saved_s, 3), "files": files})
            )
            _fsync(marker)
            _layout.remove(final)
            os.replace(pending.path, final)
            _fsync(self.root)
            for old in _layout.list_complete(self.root)[: -self.keep_last]:
                _layout.remove(old.path)
        self._barrier()
        log.info(
            "checkpoint step %d complete at %s (%.2f s after the save started)",
            pending.step,
            final,
            self.last_saved_s,
        )
        self.last_complete = final
        return final

    def close(self) -> None:
        """Finalise any pending save and release the staging buffers."""
        self.finalize()
        if self._reserving is not None:
            self._reserving.join()
        if self._stager is not None:
            self._stager.close()
            self._stager = None
        key = getattr(self._planner, "_cached_plans_key", None)
        for cache in _PLAN_CACHES:
            getattr(SavePlanner, cache, {}).pop(key, None)
        if self._holds_writer:
            global _OPEN_WRITERS
            self._holds_writer = False
            _OPEN_WRITERS -= 1
            if _OPEN_WRITERS == 0:
                _stop_writer_process()

    # -- resuming --------------------------------------------------------------------------------
    def latest(self, *, clean: bool = True, exclude: frozenset[Path] = frozenset()) -> Path | None:
        """The newest complete, intact checkpoint (same answer on every rank).

        Incomplete ones are reported and, with ``clean``, deleted by the main rank. A damaged one
        (a file missing, of the wrong size or, with ``checksums``, the wrong CRC32) is named in a
        warning and the previous one is tried, or with ``on_damaged="stop"`` raises
        :class:`CheckpointDamagedError`.
        """
        path = None
        if self.rank == 0:
            for bad in _layout.list_incomplete(self.root):
                log.warning("ignoring incomplete checkpoint %s%s", bad, " (deleting it)" if clean else "")
                if clean:
                    _layout.remove(bad)
            path = self._newest_intact(exclude)
        path = self._broadcast(path)
        if isinstance(path, BaseException):
            raise path
        return Path(path) if path else None

    def _newest_intact(self, exclude: frozenset[Path]) -> str | CheckpointDamagedError | None:
        for info in reversed(_layout.list_complete(self.root)):
            if info.path in exclude:
                continue
            problem = _damage(info.path, info.meta, checksums=self.checksums)
            if problem is None:
                return str(info.path)
            err = CheckpointDamagedError(f"checkpoint {info.path} is damaged: {problem}")
            if self.on_damaged == "stop":
                return err
            log.warning("%s; falling back to the previous complete checkpoint", err)
        return None

    def resume(self, state: dict[str, Any]) -> tuple[Path, dict] | None:
        """Load the newest intact checkpoint into ``state``; returns its path and marker metadata.

        A checkpoint that fails to load on any rank (corrupt data, a per-rank state that is not
        plait's format) is handled like a damaged one (see :meth:`latest`): named in a warning and
        the previous one tried, or with ``on_damaged="stop"`` raised. None when there is none.
        """
        tried: frozenset[Path] = frozenset()
        while (path := self.latest(exclude=tried)) is not None:
            error: CheckpointDamagedError | None = None
            try:
                meta = self.load(path, state)
            except CheckpointDamagedError as e:
                error = e
            if not self._any(error is not None):
                return path, meta
            error = error or CheckpointDamagedError(f"checkpoint {path} failed to load on another rank")
            if self.on_damaged == "stop":
                raise error
            log.warning("%s; falling back to the previous complete checkpoint", error)
            tried |= {path}
        return None

    def _any(self, flag: bool) -> bool:
        if not _initialised():
            return flag
        t = torch.tensor([int(flag)])
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.pg)
        return bool(t.item())

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
            saved = FileSystemReader(str(path)).read_metadata().state_dict_metadata
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
        self._verify(
            path,
            saved,
            _flatten(expanded),
            strict=strict,
            rank_keyed=[k for k, v in state.items() if isinstance(v, PerRankState)],
        )
        try:
            # DCP's internal load: the public dcp.load has no coordinator_rank
            _load_state_dict(
                expanded,
                storage_reader=FileSystemReader(str(path)),
                process_group=self.pg,
                coordinator_rank=self.coordinator_rank,
                no_dist=not _initialised(),
                planner=self._load_planner if self._load_planner is not None else _SafeLoadPlanner(),
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
            world_size=dist.get_world_size(self.pg) if _initialised() else 1,
            is_coordinator=self.rank == self.coordinator_rank,
        )
        if self._any(problem is not None):
            planner.restored = None
            log.info(
                "not reusing the save plan of %s (%s): the next save plans again",
                path,
                problem or "another rank's plan does not match",
            )
        else:
            log.info("reusing the save plan of %s while the state's structure is unchanged", path)

    def _verify(
        self, path: Path, saved: dict, expected: dict[str, Any], *, strict: bool, rank_keyed: list[str]
    ) -> None:
        problems = []
        missing = sorted(k for k in expected if k not in saved)
        if missing:
            problems.append(f"missing in checkpoint: {missing[:20]}{' ...' if len(missing) > 20 else ''}")
        for key, value in expected.items():
            md = saved.get(key)
            if (
                isinstance(value, torch.Tensor)
                and isinstance(md, TensorStorageMetadata)
                and tuple(md.size) != tuple(value.shape)
            ):
                problems.append(f"{key}: checkpoint shape {tuple(md.size)} != current {tuple(value.shape)}")
        if strict:
            # keys of any rank's state: pipeline stages each hold part of the model (and of the optimizer)
            every = set(expected)
            if _initialised():
                keys: list[Any] = [None] * dist.get_world_size(self.pg)
                dist.all_gather_object(keys, sorted(expected), group=self.pg)
                every = every.union(*keys)
            own = tuple(f"{k}." for k in rank_keyed)
            unexpected = sorted(k for k in saved if k not in every and not k.startswith(own))
            if unexpected:
                problems.append(
                    f"not in the current state: {unexpected[:20]}{' ...' if len(unexpected) > 20 else ''}"
                )
        if problems:
            raise CheckpointMismatchError(
                f"checkpoint {path} does not match the training state:\n  " + "\n  ".join(problems)
            )


_LOOPBACK_STORE: Any = None  # a one-process job's store for the writer process (lives as long as it)
_OPEN_WRITERS = 0  # process-mode Checkpointers not yet closed (they share DCP's one writer process)


def _stop_writer_process() -> None:
    """Stop DCP's background writer process (one per process, shared by process-mode saves) now.

    DCP keeps it until its ``__del__`` runs at interpreter exit, when the process group and store it
    was started with are already gone and the order of teardown is arbitrary; a job that ended its
    training could then still exit with an abort. Called by the last process-mode Checkpointer's
    ``close()``; a later process-mode save starts a new writer process.
    """
    from torch.distributed.checkpoint import _async_process_executor as ape

    proc = getattr(ape, "_CHECKPOINT_PROCESS", None)
    if proc is not None:
        ape._CHECKPOINT_PROCESS = None
        proc.__del__()  # sends TERMINATE and joins (SIGTERM after 5 s); a second call is a no-op


def _quiet_writer_process() -> None:
    """Start DCP's writer process through :func:`_writer_process_main` (idempotent).

    DCP's process entry sets the writer's root logger to INFO with a stream handler, so every
    checkpoint printed ``Waiting for checkpoint save request...`` and the like on the console.
    """
    from torch.distributed.checkpoint import _async_process_executor as ape

    entry = ape._AsyncCheckpointProcess.__dict__["_checkpointing_subprocess"]
    if getattr(entry, "__func__", None) is not _writer_process_main:
        ape._AsyncCheckpointProcess._checkpointing_subprocess = staticmethod(_writer_process_main)  # type: ignore[method-assign]


def _writer_process_main(pg_init_info: Any, parent_conn: Any) -> None:
    """DCP's writer process entry (run in that process) with warnings and errors only on its stderr."""
    from torch.distributed.checkpoint import _async_process_executor as ape

    def init_logger(rank: int) -> None:
        handler = logging.StreamHandler()
        handler.setFormatter(
            logging.Formatter(f"[checkpoint writer of rank {rank}] %(levelname)s %(message)s")
        )
        root = logging.getLogger()
        root.setLevel(logging.WARNING)
        root.addHandler(handler)

    ape._init_logger = init_logger  # looked up by the entry below when it starts
    ape._AsyncCheckpointProcess.__dict__["_checkpointing_subprocess"].__func__(pg_init_info, parent_conn)


def _join_job_store(world_size: int) -> None:
    """Make DCP's writer process join an existing store (under a prefix) instead of hosting its own.

    Without this, the writer process's rank 0 opens a fresh TCPStore, which listens on every
    network interface. With ``DCP_USE_PREFIX_STORE`` it connects to ``MASTER_ADDR``:``MASTER_PORT``
    as a client: the job's store under torchrun, or for a one-process job without those variables
    a store this process opens on the loopback interface (127.0.0.1).

    Raises:
        ValueError: several processes without ``MASTER_ADDR``/``MASTER_PORT`` (use torchrun, or
            init the process group with ``init_method="env://"``, or another async mode).
    """
    global _LOOPBACK_STORE
    if not (os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT")):
        if world_size > 1:
            raise ValueError(
                "checkpoint async_mode='process' needs MASTER_ADDR and MASTER_PORT in the environment "
                "(torchrun sets them): the writer processes join the job's store; use async_mode='thread' otherwise"
            )
        if _LOOPBACK_STORE is None:
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            sock.listen()
            port = sock.getsockname()[1]
            _LOOPBACK_STORE = dist.TCPStore(
                "127.0.0.1", port, None, True, master_listen_fd=sock.detach(), wait_for_workers=False
            )
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(_LOOPBACK_STORE.port)
    os.environ["DCP_USE_PREFIX_STORE"] = "1"


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
