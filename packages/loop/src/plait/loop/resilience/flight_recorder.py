"""The one module of the resilience package that touches private torch API: the NCCL flight recorder dump,
and the store of the default process group (where the ranks' progress beacons go).

``torch._C._distributed_c10d._dump_nccl_trace`` returns the recorder's pickled entries (the last
collectives of every NCCL communicator of the process: which ones started, which completed), the same
dump that torch writes on an NCCL timeout with ``TORCH_NCCL_DUMP_ON_TIMEOUT=1``; torch's
``torchfrtrace`` tool reads the files of all ranks and names the collective they disagree on. The
recorder keeps entries only with ``TORCH_NCCL_TRACE_BUFFER_SIZE`` > 0.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

__all__ = ["default_store", "dump_nccl_flight_recorder", "nccl_trace_dumper"]


def default_store() -> dist.Store | None:
    """The key-value store of the default process group (``distributed_c10d._get_default_store``: the store
    the group was created in, under its prefixes), or None without a process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        return dist.distributed_c10d._get_default_store()  # noqa: SLF001 (no public API)
    except (AttributeError, ValueError, KeyError):
        return None


def nccl_trace_dumper() -> Callable[[], bytes] | None:
    """torch's NCCL trace dump function, or None when this torch has none (no NCCL build)."""
    try:
        import torch._C._distributed_c10d as c10d
    except ImportError:
        return None
    dump: Callable[[], bytes] | None = getattr(c10d, "_dump_nccl_trace", None)
    return dump


def dump_nccl_flight_recorder(run_dir: Path, rank: int) -> Path | None:
    """Write this rank's NCCL flight recorder to a file; nothing without CUDA and an NCCL default group.

    The file is ``$TORCH_NCCL_DEBUG_INFO_TEMP_FILE<rank>`` when that variable is set (torch's own dump
    location), else ``<run_dir>/nccl_trace_rank_<rank>``.

    Returns:
        The file written, or None (gloo, no CUDA, no recorder, or the dump failed: it never raises).
    """
    try:
        if not (torch.cuda.is_available() and dist.is_available() and dist.is_initialized()):
            return None
        if dist.get_backend() != "nccl":
            return None
        dump = nccl_trace_dumper()
        if dump is None:
            return None
        data = dump()
        prefix = os.environ.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
        path = Path(f"{prefix}{rank}") if prefix else run_dir / f"nccl_trace_rank_{rank}"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        return path
    except Exception:  # a diagnostic on the way out: never let it stop the exit
        return None
