"""Module IO: load a checkpoint into an ``nn.Module`` through a mapper, save one out through a mapper."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from .dtensor import full_tensor, is_meta, local_region, local_shard, local_view
from .errors import ModelStateError, SpecMismatchError, format_keys
from .mappers import Identity, Mapper, MapperGroup, Plan, RankShard
from .reader import CheckpointReader
from .specs import Region, TensorSpec, is_full
from .writer import DEFAULT_MAX_SHARD_SIZE, CheckpointWriter

__all__ = [
    "LoadResult",
    "convert_checkpoint",
    "iter_groups",
    "load_module",
    "materialize",
    "read_state",
    "save_module",
    "state_specs",
]

Source = str | os.PathLike[str] | CheckpointReader


@dataclass(frozen=True)
class LoadResult:
    """What :func:`load_module` did.

    Attributes:
        missing: module keys nothing produced (only in non-strict mode; left as they were, or
            uninitialised for a module that was on the meta device).
        unexpected: produced keys the module lacks (never read when their group produces nothing else).
        bytes_read: tensor bytes this process read from disk.
    """

    missing: tuple[str, ...]
    unexpected: tuple[str, ...]
    bytes_read: int


def state_specs(module: nn.Module) -> dict[str, TensorSpec]:
    """Global shape and dtype of every state-dict entry of ``module`` (DTensors report global shapes)."""
    return {k: TensorSpec.of(v) for k, v in module.state_dict(keep_vars=True).items()}


@contextmanager
def _opened(source: Source) -> Iterator[CheckpointReader]:
    if isinstance(source, CheckpointReader):
        yield source
    else:
        with CheckpointReader(source) as reader:
            yield reader


def _target_region(t: torch.Tensor) -> Region | None:
    if isinstance(t, DTensor):
        region = local_region(t.shape, t.device_mesh, t.placements)
        return None if is_full(region, t.shape) else region
    return None


def _copy_into(key: str, target: torch.Tensor, value: torch.Tensor, region: Region | None) -> None:
    if isinstance(target, DTensor):
        local = target.to_local()
        if isinstance(value, DTensor):
            if tuple(value.placements) != tuple(target.placements) or value.device_mesh != target.device_mesh:
                raise SpecMismatchError(
                    f"{key!r}: mapper produced a DTensor with placements {value.placements}, "
                    f"the module holds {target.placements}"
                )
            value = value.to_local()
        elif region is None:
            value = local_shard(value, target.device_mesh, target.placements)
    else:
        local = target
        value = full_tensor(value)
    if tuple(value.shape) != tuple(local.shape):
        raise SpecMismatchError(
            f"{key!r}: got a shard of shape {list(value.shape)}, the module's is {list(local.shape)}"
        )
    local.copy_(value)


def _aliases(targets: Mapping[str, torch.Tensor]) -> dict[str, list[str]]:
    """Keys that name the same tensor (tied weights): key -> the other names."""
    by_id: dict[int, list[str]] = {}
    for k, v in targets.items():
        by_id.setdefault(id(v), []).append(k)
    return {k: [o for o in ks if o != k] for ks in by_id.values() if len(ks) > 1 for k in ks}


def _retie(module: nn.Module, aliases: Mapping[str, list[str]]) -> None:
    """Restore tied parameters that ``to_empty`` separated (it replaces each name's tensor)."""
    done: set[str] = set()
    for key, others in aliases.items():
        if key in done:
            continue
        done.update(others)
        owner, _, name = key.rpartition(".")
        source = module.get_submodule(owner)
        tensor = source._parameters.get(name)
        if tensor is None:
            continue  # tied buffers are rare; leave them
        for other in others:
            o_owner, _, o_name = other.rpartition(".")
            sub = module.get_submodule(o_owner)
            if o_name in sub._parameters:
                sub._parameters[o_name] = tensor


def materialize(module: nn.Module, device: torch.device | str | None = None) -> bool:
    """Allocate a module that holds meta tensors on ``device`` and re-tie its tied parameters.

    ``to_empty`` gives every parameter name a tensor of its own, which separates tied weights (an LM
    head sharing the embedding matrix); names that shared one parameter before share one again
    after. The values are uninitialised: load or initialise them next.

    Args:
        module: the module (plain, FSDP2 or tensor-parallel parameters).
        device: where to allocate; default: the device type of the DTensor parameters' mesh, else CPU.

    Returns:
        Whether anything was on the meta device (False: the module is left as it is).
    """
    targets = module.state_dict(keep_vars=True)
    if not any(is_meta(v) for v in targets.values()):
        return False
    if device is None:
        meshes = [v.device_mesh.device_type for v in targets.values() if isinstance(v, DTensor)]
        device = meshes[0] if meshes else "cpu"
    module.to_empty(device=device)
    _retie(module, _aliases(targets))
    return True


def load_module(
    module: nn.Module,
    source: Source,
    mapper: Mapper | None = None,
    *,
    strict: bool = True,
    allow_cast: bool = False,
    device: torch.device | str | None = None,
) -> LoadResult:
    """Load a safetensors checkpoint into ``module`` through ``mapper``, one group at a time.

    The mapper's plan is checked against the module's state dict (keys, shapes, dtypes) before any
    byte is read. Parameters that are DTensors (FSDP2 ``fully_shard``, tensor parallel) get only
    their local shard, and with plain ``Shard``/``Replicate`` placements only that shard's bytes are
    read. A module on the meta device is materialised first (``to_empty`` on ``device``; default:
    the parameters' mesh device, else CPU) and then filled. Tied parameters count as loaded when
    one of their names is.

    Args:
        module: the destination.
        source: checkpoint directory / file / index, or an open :class:`CheckpointReader`.
        mapper: checkpoint keys -> module keys (default: identity).
        strict: raise on missing or unexpected keys; otherwise skip them and report them.
        allow_cast: copy tensors of another dtype into the parameters (cast); by default a dtype
            difference is an error (add a :class:`~plait.model_state.mappers.Cast` to the mapper).
        device: where to materialise a meta module.

    Returns:
        :class:`LoadResult` with the missing/unexpected keys and the bytes read.

    Raises:
        KeyMismatchError: strict mode and keys differ (both lists in the message).
        SpecMismatchError: shapes (or dtypes) differ.
        CheckpointFormatError: a file is corrupted or truncated.
    """
    mapper = mapper or Identity()
    targets = module.state_dict(keep_vars=True)
    with _opened(source) as reader:
        plan = mapper.plan(reader.specs)
        aliases = _aliases(targets)
        # A tied name is satisfied when any of its aliases is produced.
        effective = {
            k: TensorSpec.of(v)
            for k, v in targets.items()
            if k in plan.outputs or not any(a in plan.outputs for a in aliases.get(k, ()))
        }
        report = plan.check(effective, strict=strict, check_dtype=not allow_cast)
        if materialize(module, device):
            targets = module.state_dict(keep_vars=True)
        start = reader.bytes_read
        stager = _Stager()
        with torch.no_grad():
            for group in plan.groups:
                wanted = [k for k in group.outputs if k in targets]
                if not wanted:
                    continue
                out_regions = {k: _target_region(targets[k]) for k in wanted}
                in_regions, fn = group.sliced(out_regions)
                if _direct(group, wanted, targets, out_regions, reader):
                    # Pure renames: read straight into the parameter (CPU) or via pinned memory (GPU).
                    for k in wanted:
                        src = group.renames[k]  # type: ignore[index]
                        stager.read_into(reader, src, in_regions[src], local_view(targets[k]))
                    continue
                outs = fn({k: reader.read(k, in_regions[k]) for k in group.inputs})
                for k in wanted:
                    _copy_into(k, targets[k], outs[k], out_regions[k])
                del outs
            stager.finish()
        return LoadResult(report.missing, report.unexpected, reader.bytes_read - start)


def _direct(
    group: MapperGroup,
    wanted: list[str],
    targets: Mapping[str, torch.Tensor],
    regions: Mapping[str, Region | None],
    reader: CheckpointReader,
) -> bool:
    """Whether every output of ``group`` can be read straight into its destination."""
    if group.renames is None or len(wanted) != len(group.outputs):
        return False
    for k in wanted:
        t = targets[k]
        local = local_view(t)
        if local.dtype != reader.specs[group.renames[k]].dtype or not local.is_contiguous():
            return False
        if local.device.type not in ("cpu", "cuda"):
            return False
        if isinstance(t, DTensor) and regions[k] is None and tuple(local.shape) != tuple(t.shape):
            return False  # a non-box shard (e.g. strided): computed from the full tensor instead
    return True


class _Stager:
    """Reads into CPU destinations directly, and into CUDA ones through two pinned buffers.

    While one buffer's host-to-device copy runs, the next tensor is read into the other buffer.
    """

    def __init__(self) -> None:
        self._bufs: list[torch.Tensor] = []
        self._events: list[Any] = [None, None]
        self._next = 0

    def read_into(self, reader: CheckpointReader, key: str, region: Region | None, dst: torch.Tensor) -> None:
        if dst.device.type == "cpu":
            reader.read(key, region, out=dst)
            return
        nbytes = dst.numel() * dst.element_size()
        i = self._next
        self._next = 1 - i
        if self._events[i] is not None:
            self._events[i].synchronize()
        if len(self._bufs) < 2:
            self._bufs = [torch.empty(0, dtype=torch.uint8), torch.empty(0, dtype=torch.uint8)]
        if self._bufs[i].numel() < nbytes:
            self._bufs[i] = torch.empty(max(nbytes, 64 * 2**20), dtype=torch.uint8, pin_memory=True)
        staged = self._bufs[i][:nbytes].view(dst.dtype).view(dst.shape)
        reader.read(key, region, out=staged)
        dst.copy_(staged, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._events[i] = event

    def finish(self) -> None:
        for e in self._events:
            if e is not None:
                e.synchronize()


def iter_groups(
    source: Source, mapper: Mapper | None = None, keys: set[str] | None = None
) -> Iterator[dict[str, torch.Tensor]]:
    """Stream a checkpoint through ``mapper``: yields the outputs of one group at a time.

    Args:
        source: checkpoint path or reader.
        mapper: the mapping (default identity).
        keys: only run the groups producing these output keys (others are never read).
    """
    with _opened(source) as reader:
        plan = (mapper or Identity()).plan(reader.specs)
        for group in plan.groups:
            if not group.outputs or (keys is not None and not keys & group.output_keys):
                continue
            out = group.fn({k: reader.read(k) for k in group.inputs})
            yield out if keys is None else {k: v for k, v in out.items() if k in keys}


def read_state(
    source: Source, mapper: Mapper | None = None, keys: set[str] | None = None
) -> dict[str, torch.Tensor]:
    """A whole (mapped) checkpoint as a dict; for small checkpoints and tests."""
    out: dict[str, torch.Tensor] = {}
    for part in iter_groups(source, mapper, keys):
        out.update(part)
    return out


def _dist_info(group: dist.ProcessGroup | None, distributed: bool | None) -> tuple[bool, int]:
    if distributed is None:
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
    return distributed, (dist.get_rank(group) if distributed else 0)


def save_module(
    module: nn.Module,
    out_dir: str | os.PathLike[str],
    mapper: Mapper | None = None,
    *,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    metadata: Mapping[str, str] | None = None,
    is_writer: bool | None = None,
    group: dist.ProcessGroup | None = None,
    distributed: bool | None = None,
    fsync: bool = True,
) -> Path:
    """Write ``module``'s state through ``mapper`` into a safetensors checkpoint, group by group.

    DTensor entries are gathered (``full_tensor()``) one group at a time, so host memory stays near
    one group; every rank holding a shard must call this (the gathers are collectives). Collective
    over ``group`` (default: the world when torch.distributed is initialised): each rank passes
    its own module (e.g. its pipeline stage) and ``is_writer`` says whether it writes its keys
    (default: only the group's first rank). The first rank merges one Hugging Face index.

    Args:
        module: the source module (no meta tensors).
        out_dir: checkpoint directory (created if missing; only the writer's files are replaced, see
            :class:`CheckpointWriter`).
        mapper: module keys -> checkpoint keys (default identity).
        max_shard_size: per-file bound (``int`` bytes or ``"5GB"``).
        metadata: string metadata for file headers and the index.
        is_writer: whether this rank writes its module's keys.
        group: process group of the save.
        distributed: force (or disable) the collective path.
        fsync: fsync files before publishing.

    Returns:
        The checkpoint directory.
    """
    distributed, rank = _dist_info(group, distributed)
    if is_writer is None:
        is_writer = rank == 0
    state = module.state_dict()
    meta = [k for k, v in state.items() if is_meta(v)]
    if meta:
        raise ModelStateError(f"cannot save meta tensors (never materialised): {format_keys(meta)}")
    plan = (mapper or Identity()).plan({k: TensorSpec.of(v) for k, v in state.items()})
    writer = CheckpointWriter(
        out_dir,
        plan.outputs if is_writer else {},
        max_shard_size=max_shard_size,
        metadata=metadata,
        group=group,
        distributed=distributed,
        fsync=fsync,
    )
    needs_gather = any(isinstance(v, DTensor) for v in state.values())
    try:
        if is_writer or needs_gather:
            _stream(plan, lambda k: full_tensor(state[k]), writer if is_writer else None)
    except BaseException:
        writer.abort()
        raise
    return writer.commit()


def _stream(plan: Plan, fetch: object, writer: CheckpointWriter | None) -> None:
    for group in plan.groups:
        if not group.outputs:
            continue
        tensors = {k: fetch(k) for k in group.inputs}  # type: ignore[operator]
        if writer is None:
            continue  # a non-writing rank only joins the gathers
        for k, v in group.fn(tensors).items():
            writer.write(k, full_tensor(v))
        del tensors


def convert_checkpoint(
    source: Source,
    out_dir: str | os.PathLike[str],
    mapper: Mapper | None = None,
    *,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    metadata: Mapping[str, str] | None = None,
    group: dist.ProcessGroup | None = None,
    distributed: bool | None = None,
    fsync: bool = True,
) -> Path:
    """Convert a checkpoint on disk through ``mapper`` into a new one, streaming group by group.

    With torch.distributed initialised (or ``distributed=True``) the groups are split across the
    ranks of ``group`` (:class:`~plait.model_state.mappers.RankShard`, balanced by bytes); each rank
    reads and writes only its share and the first rank merges the index.
    """
    distributed, rank = _dist_info(group, distributed)
    mapper = mapper or Identity()
    with _opened(source) as reader:
        if distributed:
            mapper = RankShard(mapper, dist.get_world_size(group), rank)
        plan = mapper.plan(reader.specs)
        writer = CheckpointWriter(
            out_dir,
            plan.outputs,
            max_shard_size=max_shard_size,
            metadata=metadata,
            group=group,
            distributed=distributed,
            fsync=fsync,
        )
        try:
            _stream(plan, reader.read, writer)
        except BaseException:
            writer.abort()
            raise
        return writer.commit()
