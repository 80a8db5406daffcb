"""The vocabulary-parallel path: the process group (travelling as its name) and this rank's vocabulary offset."""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.distributed as dist

__all__ = ["process_group_by_name", "vocab_offset"]


def process_group_by_name(name: str | None) -> dist.ProcessGroup | None:
    """The process group a custom op received by name (``None`` for no group)."""
    if name is None:
        return None
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(cast(Any, name))  # a str; newer torch types it as GroupName


def vocab_offset(local_vocab: int, group: dist.ProcessGroup | None, device: torch.device) -> int:
    """The global id of this rank's first vocabulary entry (shards ordered by rank, sizes may differ)."""
    if group is None:
        return 0
    # Shards may differ in size: gather them (one tiny tensor collective, NCCL- and gloo-friendly).
    world = dist.get_world_size(group)
    mine = torch.tensor([local_vocab], dtype=torch.int64, device=device)
    sizes = torch.empty(world, dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(sizes, mine, group=group)
    return int(sizes[: dist.get_rank(group)].sum())
