"""The write phase: DCP writes the staged state into the checkpoint's partial directory, now
(synchronously) or from a background process or thread."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from plait.loop.checkpoint import dcp_compat
from plait.loop.checkpoint.dcp_compat import ReusingStager
from torch.distributed.checkpoint.planner import SavePlanner
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.checkpoint.storage import StorageWriter

__all__ = ["write_async", "write_now"]


def write_now(
    state: dict[str, Any],
    path: Path,
    writer: StorageWriter | None,
    *,
    planner: SavePlanner,
    process_group: dist.ProcessGroup | None,
    coordinator_rank: int,
    no_dist: bool,
) -> None:
    """Write ``state`` into ``path`` and return when every rank's files are written."""
    dcp_compat.save_state_dict(
        state,
        writer if writer is not None else dcp.FileSystemWriter(str(path)),
        process_group=process_group,
        coordinator_rank=coordinator_rank,
        no_dist=no_dist,
        planner=planner,
    )


def write_async(
    state: dict[str, Any],
    path: Path,
    writer: StorageWriter | None,
    *,
    planner: SavePlanner,
    process_group: dist.ProcessGroup | None,
    in_process: bool,
    stager: ReusingStager | None,
) -> Any:
    """Start writing ``state`` into ``path`` from DCP's writer process (``in_process``) or a thread;
    returns DCP's response (a future, or one with ``staging_completion``/``upload_completion``)."""
    return dcp.async_save(
        state,
        checkpoint_id=str(path),
        storage_writer=writer,
        planner=planner,
        process_group=process_group,
        async_checkpointer_type=AsyncCheckpointerType.PROCESS if in_process else AsyncCheckpointerType.THREAD,
        async_stager=stager,
    )
