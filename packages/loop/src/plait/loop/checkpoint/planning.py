"""A DCP save planner whose cached global plan survives a restart (Megatron-Core's plan reuse).

DCP's ``DefaultSavePlanner(enable_plan_caching=True)`` keeps, per cache key, each rank's local
plan and final plan and, on the coordinator, every rank's plan, the global plan and the metadata
(class-level dicts on ``SavePlanner``). A save whose local plans all equal the cached ones sends
empty plans and reuses the cached global plan and metadata: no global planning. Those caches live
in the process that plans (the writer process in ``async_mode="process"``), so they are lost when
the job restarts.

:class:`CachingSavePlanner` writes them with every checkpoint (``plan.rank<R>.pt``, one per rank,
DCP's plan dataclasses only, read back with ``torch.load(weights_only=True)``), and
:meth:`CachingSavePlanner.restore` reads them after that checkpoint was loaded, checking them
against the checkpoint's own metadata (every key, shape, dtype and chunk). The first save after the
restart then starts from the restored caches: with the state's structure unchanged it skips global
planning, with a changed structure (a new key, another shape or sharding) DCP's own comparison of
the local plans plans again.
"""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path
from typing import Any

import torch
from plait.loop.checkpoint import dcp_compat
from plait.loop.checkpoint.dcp_compat import GLOBAL_PLAN_CACHES as _GLOBAL
from plait.loop.checkpoint.dcp_compat import LOCAL_PLAN_CACHES as _LOCAL
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint import metadata as _md
from torch.distributed.checkpoint import planner as _planner
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType

__all__ = ["PLAN_CACHE_KEYS", "CachingSavePlanner", "PlanCacheKeys", "plan_file"]

_FORMAT = "plait-plan/1"
# DCP's plan records: dataclasses and enums of plain values, nothing that runs code when built.
_SAFE = [
    getattr(module, name)
    for module, names in (
        (
            _planner,
            ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "BytesIOWriteData"),
        ),
        (
            _md,
            (
                "Metadata",
                "MetadataIndex",
                "ChunkStorageMetadata",
                "TensorProperties",
                "TensorStorageMetadata",
                "BytesStorageMetadata",
            ),
        ),
    )
    for name in names
    if hasattr(module, name)
] + [*dcp_compat.plan_record_types(), torch.Size]


class PlanCacheKeys:
    """Hands out the keys of DCP's save-plan caches, one per planner.

    DCP keys its plan caches (class-level dicts, so process-wide) by the planner's class name, so two
    checkpointers in one process would mix their plans (a checkpoint of one state planned with
    another's chunks). Process-wide because those caches are: :data:`PLAN_CACHE_KEYS` is the one
    instance.
    """

    def __init__(self) -> None:
        self._numbers = itertools.count()

    def assign(self, planner: SavePlanner) -> None:
        """Give ``planner``'s plan caches a key no other planner of this process has."""
        dcp_compat.set_plan_cache_key(planner, f"plait.Checkpointer/{next(self._numbers)}")

    @staticmethod
    def drop(planner: SavePlanner) -> None:
        """Forget ``planner``'s cached plans in this process."""
        dcp_compat.drop_plan_caches(planner)


PLAN_CACHE_KEYS = PlanCacheKeys()
"""Process-wide, as DCP's plan caches are."""


def plan_file(rank: int) -> str:
    """The name of rank ``rank``'s plan file in a checkpoint directory."""
    return f"plan.rank{rank}.pt"


class CachingSavePlanner(DefaultSavePlanner):
    """DCP's ``DefaultSavePlanner`` with plan caching, whose caches are saved with each checkpoint
    and restored after a restart (see the module docstring).

    Subclass it for a custom planner that keeps the reuse across restarts; the
    :class:`~plait.loop.checkpoint.Checkpointer` sets :attr:`plan_file` before each save and calls
    :meth:`restore` after a load. Keyword arguments are ``DefaultSavePlanner``'s (plan caching is
    always on).
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(enable_plan_caching=True, **kwargs)
        self.plan_file: str | None = None  # where finish_plan writes this rank's caches
        self.restored: dict[str, Any] | None = None  # caches to start from (see restore)

    def set_up_planner(self, state_dict: Any, storage_meta: Any = None, is_coordinator: bool = False) -> None:
        super().set_up_planner(state_dict, storage_meta, is_coordinator)
        # The process that plans (maybe DCP's writer process) starts from the restored caches once.
        key = dcp_compat.plan_cache_key(self)
        if self.restored is not None and key not in dcp_compat.plan_cache(_LOCAL[0]):
            for name, value in self.restored.items():
                if name in _LOCAL + _GLOBAL:
                    dcp_compat.plan_cache(name)[key] = value

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        plan = super().finish_plan(new_plan)
        if self.plan_file is not None:
            torch.save(self._caches(), self.plan_file)
        return plan

    def _caches(self) -> dict[str, Any]:
        key = dcp_compat.plan_cache_key(self)
        names = _LOCAL + (_GLOBAL if self.is_coordinator else ())
        caches = {name: dcp_compat.plan_cache(name)[key] for name in names}
        if "_cached_metadata" in caches:  # where the last save put each chunk is not part of the plan
            md = caches["_cached_metadata"]
            fields = {f: None for f in ("storage_data", "storage_meta") if hasattr(md, f)}
            caches["_cached_metadata"] = dataclasses.replace(md, **fields)
        return {"format": _FORMAT, "coordinator": self.is_coordinator, **caches}

    def restore(
        self, file: Path, saved: dict[str, Any], *, world_size: int, is_coordinator: bool
    ) -> str | None:
        """Read plan file ``file`` and keep its caches for the next save if they match the
        checkpoint's metadata ``saved`` (its ``state_dict_metadata``).

        Returns what is wrong (then nothing is kept), or None. Every rank must agree before the
        caches are used: the caller drops them (``restored = None``) where any rank failed.
        """
        self.restored = None
        if not file.is_file():
            return f"{file.name} is missing"
        try:
            with torch.serialization.safe_globals(_SAFE):
                caches = torch.load(file, weights_only=True)
        except Exception as e:
            return f"{file.name} cannot be read: {type(e).__name__}: {str(e)[:300]}"
        if not isinstance(caches, dict) or caches.get("format") != _FORMAT:
            return f"{file.name} is not a plait plan file"
        if caches["coordinator"] != is_coordinator:
            return (
                f"{file.name} was written by {'the' if caches['coordinator'] else 'a non-'}coordinator rank"
            )
        if is_coordinator:
            plans = caches["_cached_all_plans"]
            if len(plans) != world_size:
                return f"{file.name} holds the plans of {len(plans)} ranks, the job has {world_size}"
            if caches["_cached_metadata"].state_dict_metadata != saved:
                return f"{file.name}: the planned keys, shapes, dtypes or chunks differ from the checkpoint's"
        for item in caches["_cached_final_save_plan"].items:
            if (problem := _unsaved(item, saved)) is not None:
                return f"{file.name}: {problem}"
        self.restored = caches
        return None


def _unsaved(item: Any, saved: dict[str, Any]) -> str | None:
    """Why write item ``item`` is not in the checkpoint's metadata ``saved``, or None."""
    md = saved.get(item.index.fqn)
    if md is None:
        return f"{item.index.fqn} is not in the checkpoint"
    if item.type == WriteItemType.BYTE_IO:
        return (
            None
            if isinstance(md, _md.BytesStorageMetadata)
            else f"{item.index.fqn} is not bytes in the checkpoint"
        )
    data = item.tensor_data
    if not isinstance(md, _md.TensorStorageMetadata) or md.size != data.size:
        return f"{item.index.fqn}: the checkpoint has another shape"
    if md.properties.dtype != data.properties.dtype:
        return f"{item.index.fqn}: the checkpoint has dtype {md.properties.dtype}, the plan {data.properties.dtype}"
    if data.chunk not in md.chunks:
        return f"{item.index.fqn}: the chunk at {tuple(data.chunk.offsets)} is not in the checkpoint"
    return None
