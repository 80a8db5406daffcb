"""Every use of torch.distributed.checkpoint (DCP) internals by plait's checkpointing, in one place.

DCP's public API has no coordinator rank for ``save``/``load``, no way to reuse host buffers across
async saves, to choose the writer process's log level, to stop the writer process before
interpreter exit, or to key the save-plan caches per planner instance. plait reaches those through
the private names below and nowhere else; ``tests/loop/checkpoint/test_dcp_compat.py`` checks that
each still exists with the signature or attributes used here, so a torch upgrade that changes one
fails there, by name, instead of somewhere inside a save.
"""

from __future__ import annotations

import os
import signal
import uuid
import weakref
from collections.abc import Callable, MutableMapping
from typing import Any

import torch
import torch.cuda._pin_memory_utils as pin_memory_utils
import torch.distributed as dist
from torch.distributed.checkpoint import _async_process_executor as ape
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint._state_dict_stager import StateDictStager
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.filesystem import _StoragePrefix
from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING
from torch.distributed.checkpoint.planner import LoadPlanner, SavePlanner
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
from torch.distributed.checkpoint.state_dict_saver import _save_state_dict, _stateful_to_state_dict
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter
from torch.distributed.tensor import DTensor

__all__ = [
    "GLOBAL_PLAN_CACHES",
    "LOCAL_PLAN_CACHES",
    "PLAN_CACHES",
    "PLAN_CACHE_KEY_ATTR",
    "PREFIX_STORE_ENV",
    "STORE_NAMESPACE_ATTR",
    "ReusingStager",
    "drop_plan_caches",
    "flatten",
    "load_state_dict",
    "plan_cache",
    "plan_cache_key",
    "plan_record_types",
    "prepare_writer_process_start",
    "route_writer_process_entry",
    "run_writer_process_entry",
    "save_state_dict",
    "set_element",
    "set_plan_cache_key",
    "stop_writer_process",
    "use_job_store",
    "writer_init_info",
    "writer_process",
]

# -- save and load with a coordinator rank (the public dcp.save/dcp.load have none) -----------------


def save_state_dict(
    state: dict[str, Any],
    writer: StorageWriter,
    *,
    process_group: dist.ProcessGroup | None,
    coordinator_rank: int,
    no_dist: bool,
    planner: SavePlanner,
) -> None:
    """DCP's synchronous save of ``state`` (Stateful objects expanded by DCP's own rule)."""
    _save_state_dict(
        state_dict=_stateful_to_state_dict(state),
        storage_writer=writer,
        process_group=process_group,
        coordinator_rank=coordinator_rank,
        no_dist=no_dist,
        planner=planner,
    )


def load_state_dict(
    state: dict[str, Any],
    reader: StorageReader,
    *,
    process_group: dist.ProcessGroup | None,
    coordinator_rank: int,
    no_dist: bool,
    planner: LoadPlanner,
) -> None:
    """DCP's load into the already expanded ``state``, in place."""
    _load_state_dict(
        state,
        storage_reader=reader,
        process_group=process_group,
        coordinator_rank=coordinator_rank,
        no_dist=no_dist,
        planner=planner,
    )


def flatten(expanded: dict[str, Any]) -> dict[str, Any]:
    """Flatten a state dict whose Stateful objects are expanded the way DCP does (keys joined by '.')."""
    flat, _ = flatten_state_dict(expanded)
    return flat


# -- staging buffers ------------------------------------------------------------------------------


class _KeepBuffers(StateDictStager):
    """A StateDictStager whose pinned host buffers live as long as its :class:`ReusingStager`, not one save.

    torch 2.10/2.11's DefaultStager closes its StateDictStager after every stage. That drops the cached
    host buffers and empties the copy-dispatch table, so the second save fails with
    ``KeyError: <class 'type'>`` (and every save would allocate and pin the whole state again).
    Later torch no longer closes it; either way :meth:`ReusingStager.close` releases the buffers.
    """

    def close(self) -> None:  # what DefaultStager calls after each stage on torch <= 2.11
        pass

    def release(self) -> None:
        super().close()

    def reserve(self, tensors: list[torch.Tensor]) -> None:
        """Allocate (share, pin) the host buffer of each tensor's storage now, without copying.

        The same buffers the first stage would allocate, in the same cache, so that the first save
        only copies.
        """
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

    def cached_buffers(self) -> MutableMapping[Any, Any]:
        """The host buffer of each staged (or reserved) storage."""
        return self._cached_storage_mapping


class ReusingStager(DefaultStager):
    """DCP's DefaultStager (pinned/shared host copies in a background thread) that reuses its host
    buffers across saves, can allocate them ahead of the first save (:meth:`reserve`) and releases
    them in :meth:`close`."""

    def __init__(self, options: StagingOptions) -> None:
        super().__init__(options)
        self._state_dict_stager: _KeepBuffers = _KeepBuffers(
            pin_memory=options.use_pinned_memory, share_memory=options.use_shared_memory
        )

    def reserve(self, tensors: list[torch.Tensor]) -> None:
        """Allocate the host buffers of ``tensors`` now, without copying."""
        self._state_dict_stager.reserve(tensors)

    def cached_buffers(self) -> MutableMapping[Any, Any]:
        """The host buffer of each staged (or reserved) storage."""
        return self._state_dict_stager.cached_buffers()

    def close(self) -> None:
        super().close()
        self._state_dict_stager.release()


# -- save-plan caches (class-level dicts on SavePlanner, keyed per planner) -----------------------

PLAN_CACHE_KEY_ATTR = "_cached_plans_key"
LOCAL_PLAN_CACHES = ("_cached_save_plan", "_cached_final_save_plan")
GLOBAL_PLAN_CACHES = ("_cached_all_plans", "_cached_global_plan", "_cached_metadata")
PLAN_CACHES = LOCAL_PLAN_CACHES + GLOBAL_PLAN_CACHES


def plan_cache(name: str) -> dict[str, Any]:
    """DCP's process-wide save-plan cache ``name`` (one of :data:`PLAN_CACHES`), keyed by planner key."""
    cache: dict[str, Any] = getattr(SavePlanner, name)
    return cache


def set_plan_cache_key(planner: SavePlanner, key: str) -> None:
    """Key ``planner``'s plan caches by ``key`` instead of its class name."""
    setattr(planner, PLAN_CACHE_KEY_ATTR, key)


def plan_cache_key(planner: SavePlanner) -> str:
    """The key of ``planner``'s plan caches ("" for a planner without plan caching)."""
    return str(getattr(planner, PLAN_CACHE_KEY_ATTR, ""))


def drop_plan_caches(planner: SavePlanner) -> None:
    """Forget every cached plan of ``planner`` in this process."""
    key = plan_cache_key(planner)
    for name in PLAN_CACHES:
        getattr(SavePlanner, name, {}).pop(key, None)


def plan_record_types() -> list[Any]:
    """DCP's private types that occur in a saved plan (allowed for ``torch.load(weights_only=True)``)."""
    return [_StoragePrefix, _MEM_FORMAT_ENCODING]


# -- DCP's writer process (one per Python process, a module global of DCP's) -----------------------

PREFIX_STORE_ENV = "DCP_USE_PREFIX_STORE"
STORE_NAMESPACE_ATTR = "plait_store_namespace"
"""The attribute of DCP's writer-process init info that carries the writers' key namespace in the store."""


def writer_process() -> Any:
    """DCP's running writer process of this Python process, or None."""
    return ape._CHECKPOINT_PROCESS


def writer_init_info(process_group: dist.ProcessGroup | None) -> Any:
    """DCP's init info of a writer process (a collective, on every rank), with a key namespace of its own.

    The writers build their gloo group in the job's store under a fixed prefix, and that store outlives
    them: torchrun's agent keeps one store for every restart of its group (as a process keeps its store
    for a later writer), so a dead writer's address is still there and a new writer may read it and
    connect to it ("connectFullMesh ... Connection refused", or a hang). A namespace that rank 0 draws now
    and broadcasts over this live group is new to the store (:data:`STORE_NAMESPACE_ATTR`).
    """
    info = ape._ProcessGroupInitInfo(process_group)
    namespace = [uuid.uuid4().hex if dist.get_rank(process_group) == 0 else ""]
    dist.broadcast_object_list(namespace, group=process_group, group_src=0)
    setattr(info, STORE_NAMESPACE_ATTR, namespace[0])
    return info


def prepare_writer_process_start(process_group: dist.ProcessGroup | None) -> Callable[[], None] | None:
    """Gather what DCP's writer process needs now (a collective, on every rank) and return a
    function that starts it (may run in another thread); None when it is already running."""
    if ape._CHECKPOINT_PROCESS is not None:
        return None
    info = writer_init_info(process_group)

    def start() -> None:
        # The writer is spawned with SIGINT blocked (a child inherits its spawning thread's signal mask),
        # so that a Ctrl-C reaching the terminal's whole group while it still imports cannot kill it; its
        # entry ignores SIGINT and only then unblocks it (see ``writer_process._writer_process_main``).
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            ape._CHECKPOINT_PROCESS = ape._AsyncCheckpointProcess(info)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)

    return start


def stop_writer_process() -> None:
    """Stop DCP's writer process now (sends TERMINATE and joins; SIGTERM after 5 s); a later async
    save starts a new one. DCP would otherwise stop it only in ``__del__`` at interpreter exit."""
    proc = ape._CHECKPOINT_PROCESS
    if proc is not None:
        ape._CHECKPOINT_PROCESS = None
        proc.__del__()
        # Reaped here: the __del__ of garbage collection must find it dead. A writer that outlived the 5 s
        # and got SIGTERM may not be reaped yet, and that second __del__ would send TERMINATE down its
        # closed pipe (a BrokenPipeError traceback at exit).
        process = proc._save_process
        process.join(timeout=5)
        if process.is_alive():
            process.kill()
            process.join()


# DCP's own writer-process entry, kept before any routing replaces the class attribute.
DCP_WRITER_ENTRY: Callable[[Any, Any], None] = ape._AsyncCheckpointProcess.__dict__[
    "_checkpointing_subprocess"
].__func__


def route_writer_process_entry(entry: Callable[[Any, Any], None]) -> None:
    """Make DCP start its writer process through ``entry(pg_init_info, parent_conn)`` (idempotent);
    ``entry`` runs DCP's own entry with :func:`run_writer_process_entry`."""
    current = ape._AsyncCheckpointProcess.__dict__["_checkpointing_subprocess"]
    if getattr(current, "__func__", None) is not entry:
        ape._AsyncCheckpointProcess._checkpointing_subprocess = staticmethod(entry)  # type: ignore[method-assign,assignment]


def run_writer_process_entry(
    pg_init_info: Any, parent_conn: Any, *, init_logger: Callable[[int], None]
) -> None:
    """Run DCP's writer process entry (in the writer process) with ``init_logger(rank)`` in place of
    DCP's logger setup (which sets the root logger to INFO on the console), and its keys in the store
    under the namespace :func:`writer_init_info` drew (:data:`STORE_NAMESPACE_ATTR`)."""
    ape._init_logger = init_logger  # type: ignore[assignment]  # looked up by the entry when it starts
    namespace = getattr(pg_init_info, STORE_NAMESPACE_ATTR, "")
    if namespace:  # the entry wraps the store as PrefixStore("AsyncCheckpointProcess/", store)

        def prefix_store(prefix: str, store: dist.Store) -> dist.PrefixStore:
            return dist.PrefixStore(f"{prefix}{namespace}", store)

        ape.PrefixStore = prefix_store  # type: ignore[misc,assignment]  # this process is the writer's own
    DCP_WRITER_ENTRY(pg_init_info, parent_conn)


def use_job_store(address: str | None = None, port: int | None = None) -> None:
    """Make DCP's writer process connect to the store at ``MASTER_ADDR``:``MASTER_PORT`` under a
    prefix instead of hosting a store of its own; ``address``/``port``, when given, are set as those
    variables first. DCP reads only the environment, so this writes ``os.environ``."""
    if address is not None and port is not None:
        os.environ["MASTER_ADDR"] = address
        os.environ["MASTER_PORT"] = str(port)
    os.environ[PREFIX_STORE_ENV] = "1"
