"""The resume phase's reading: find the newest intact checkpoint, check its structure against the
state, and load it with non-tensor items read ``weights_only``."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from plait.loop.checkpoint import _layout
from plait.loop.checkpoint.dcp_compat import set_element
from plait.loop.checkpoint.errors import CheckpointDamagedError, CheckpointMismatchError
from plait.loop.checkpoint.group import CheckpointGroup, initialised
from plait.loop.checkpoint.integrity import damage
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

__all__ = ["SafeLoadPlanner", "check_structure", "newest_intact"]

log = logging.getLogger(__name__)


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, except that non-tensor items load with ``torch.load(weights_only=True)``
    (plain data and tensors only; DCP's own planner unpickles them without restriction)."""

    def load_bytes(self, read_item: Any, value: Any) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def newest_intact(
    root: Path, exclude: frozenset[Path], *, checksums: bool, stop_on_damaged: bool
) -> str | CheckpointDamagedError | None:
    """The newest complete checkpoint under ``root`` (not in ``exclude``) whose files match its
    marker; a damaged one is warned about and skipped, or with ``stop_on_damaged`` returned as the error."""
    for info in reversed(_layout.list_complete(root)):
        if info.path in exclude:
            continue
        problem = damage(info.path, info.meta, checksums=checksums)
        if problem is None:
            return str(info.path)
        err = CheckpointDamagedError(f"checkpoint {info.path} is damaged: {problem}")
        if stop_on_damaged:
            return err
        log.warning("%s; falling back to the previous complete checkpoint", err)
    return None


def check_structure(
    path: Path,
    saved: dict,
    expected: dict[str, Any],
    *,
    strict: bool,
    rank_keyed: list[str],
    group: CheckpointGroup,
) -> None:
    """Raise :class:`CheckpointMismatchError` listing the keys of ``expected`` missing in the
    checkpoint's metadata ``saved``, the shapes that differ and (with ``strict``) the saved keys no
    rank's state has (a collective with ``strict``)."""
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
        if initialised():
            every = every.union(*group.all_keys(sorted(expected)))
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
