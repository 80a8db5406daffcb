"""Asynchronous, atomic, resumable checkpoints on torch.distributed.checkpoint (DCP).

Follows Megatron-Core's split of a save into phases:

1. **stage**: tensors are copied to (pinned, shared) host memory; training may continue once the
   copy is done (:meth:`Checkpointer.wait_for_staging` guards the next optimizer step).
2. **write**: a background process (or thread) plans and writes the files. DCP's save planner runs
   with plan caching, so while the state's structure is unchanged later saves reuse the cached
   global plan instead of planning again.
3. **finalise**: every rank's write is done, a barrier, then the main rank writes the marker and
   renames ``.step_N.partial`` to ``step_N``: the checkpoint becomes visible atomically. The
   previous save is finalised before the next starts and before exit.
"""

from __future__ import annotations

import json
import logging
import os
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from plait.loop.checkpoint import _layout
from plait.loop.checkpoint.state import PerRankState
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemReader
from torch.distributed.checkpoint._state_dict_stager import StateDictStager
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

log = logging.getLogger(__name__)

AsyncMode = Literal["process", "thread", "off"]


class CheckpointMismatchError(RuntimeError):
    """The checkpoint on disk does not fit the state it is loaded into; the message lists what differs."""


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
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, _ = flatten_state_dict(expanded)
    return flat


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
    """

    def __init__(
        self,
        root: str | Path,
        *,
        keep_last: int = 3,
        async_mode: AsyncMode = "process",
        process_group: dist.ProcessGroup | None = None,
        pin_memory: bool | None = None,
    ) -> None:
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        if async_mode not in ("process", "thread", "off"):
            raise ValueError(f"async_mode must be 'process', 'thread' or 'off', got {async_mode!r}")
        self.root = Path(root)
        self.keep_last = keep_last
        self.pg = process_group
        if async_mode == "process" and not _initialised():
            log.info("no process group: checkpoints are written from a background thread, not a process")
            async_mode = "thread"
        self.async_mode: AsyncMode = async_mode
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
        # one skips building the global plan (DCP keeps the cache per planner class).
        self._planner = DefaultSavePlanner(enable_plan_caching=True)
        self._pending: _Pending | None = None
        self.last_stall_s = 0.0

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
        if self.async_mode == "off" or blocking:
            dcp.save(state, checkpoint_id=str(path), planner=self._planner, process_group=self.pg)
            self._pending = _Pending(step, path, None, t0)
            self.finalize()
        else:
            response = dcp.async_save(
                state,
                checkpoint_id=str(path),
                planner=self._planner,
                process_group=self._dcp_pg,
                async_checkpointer_type=AsyncCheckpointerType.PROCESS
                if self.async_mode == "process"
                else AsyncCheckpointerType.THREAD,
                async_stager=self._stager,
            )
            self._pending = _Pending(step, path, response, t0)
        self.last_stall_s = time.perf_counter() - t0

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
        self._barrier()
        final = _layout.final_dir(self.root, pending.step)
        if self.rank == 0:
            marker = pending.path / _layout.MARKER
            marker.write_text(
                json.dumps({**self._meta, "saved_s": round(time.perf_counter() - pending.started, 3)})
            )
            _fsync(marker)
            _layout.remove(final)
            os.replace(pending.path, final)
            _fsync(self.root)
            for old in _layout.list_complete(self.root)[: -self.keep_last]:
                _layout.remove(old.path)
        self._barrier()
        log.info("checkpoint step %d complete at %s", pending.step, final)
        return final

    def close(self) -> None:
        """Finalise any pending save and release the staging buffers."""
        self.finalize()
        if self._stager is not None:
            self._stager.close()
            self._stager = None

    # -- resuming --------------------------------------------------------------------------------
    def latest(self, *, clean: bool = True) -> Path | None:
        """The newest complete checkpoint (same answer on every rank); incomplete ones are reported
        and, with ``clean``, deleted by the main rank."""
        path = None
        if self.rank == 0:
            for bad in _layout.list_incomplete(self.root):
                log.warning("ignoring incomplete checkpoint %s%s", bad, " (deleting it)" if clean else "")
                if clean:
                    _layout.remove(bad)
            complete = _layout.list_complete(self.root)
            path = str(complete[-1].path) if complete else None
        path = self._broadcast(path)
        return Path(path) if path else None

    def load(self, path: str | Path, state: dict[str, Any], *, strict: bool = True) -> dict:
        """Restore ``state`` in place from checkpoint ``path``; returns the checkpoint's marker metadata.

        The checkpoint's structure is checked against ``state`` first: missing keys, shape
        mismatches and (with ``strict``) keys the state does not have raise
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
        expanded = {k: (v.state_dict() if hasattr(v, "state_dict") else v) for k, v in state.items()}
        self._verify(
            path,
            saved,
            _flatten(expanded),
            strict=strict,
            rank_keyed=[k for k, v in state.items() if isinstance(v, PerRankState)],
        )
        dcp.load(expanded, checkpoint_id=str(path), process_group=self.pg)
        for k, v in state.items():
            if hasattr(v, "load_state_dict"):
                v.load_state_dict(expanded[k])
        return meta

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
            own = tuple(f"{k}." for k in rank_keyed)
            unexpected = sorted(k for k in saved if k not in expected and not k.startswith(own))
            if unexpected:
                problems.append(
                    f"not in the current state: {unexpected[:20]}{' ...' if len(unexpected) > 20 else ''}"
                )
        if problems:
            raise CheckpointMismatchError(
                f"checkpoint {path} does not match the training state:\n  " + "\n  ".join(problems)
            )


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
