"""Full tensor -> local DTensor shard (no communication), and DTensor -> full tensor."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.placement_types import Placement

from ..dtensor import full_tensor, local_region, local_shard, to_dtensor
from ..errors import MapperError
from ..specs import Region, TensorSpec, is_full
from .base import GroupFn, Keys, Mapper, MapperGroup, _PerTensor
from .templates import as_templates

__all__ = ["Distribute", "Gather"]

Placements = Sequence[Placement]
PlacementRule = Placements | Mapping[str, Placements] | Callable[[str, TensorSpec], Placements | None]


class Distribute(_PerTensor):
    """Turns full tensors into DTensors on ``mesh`` holding only this rank's shard.

    No communication: every rank computes its own shard, and with plain ``Shard``/``Replicate``
    placements a reader fetches only the bytes of that shard.

    Args:
        mesh: the device mesh.
        placements: one placement list for every matching key, a mapping from key template to
            placements (first match wins; unmatched keys are not distributed), or a callable
            ``(key, spec) -> placements | None``.
        keys: templates of the keys to distribute (default: all).
    """

    def __init__(self, mesh: DeviceMesh, placements: PlacementRule, keys: Keys = "{*key}") -> None:
        super().__init__(keys)
        self.mesh = mesh
        self.placements = placements
        if isinstance(placements, Mapping):
            self._rules = [(as_templates(k)[0], list(v)) for k, v in placements.items()]

    def _placements_for(self, key: str, spec: TensorSpec) -> list[Placement] | None:
        p = self.placements
        if isinstance(p, Mapping):
            for t, v in self._rules:
                if t.match(key) is not None:
                    return v
            return None
        if callable(p):
            got = p(key, spec)
            return None if got is None else list(got)
        return list(p)

    def _group(self, key: str, spec: TensorSpec) -> MapperGroup | None:
        placements = self._placements_for(key, spec)
        if placements is None:
            return None
        if len(placements) != self.mesh.ndim:
            raise MapperError(
                f"Distribute: {key!r} has {len(placements)} placements for a {self.mesh.ndim}-dim mesh"
            )
        mesh = self.mesh
        region = local_region(spec.shape, mesh, placements)

        def fn(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            return {key: to_dtensor(local_shard(t[key], mesh, placements), mesh, placements, spec.shape)}

        def sliced(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            return {key: to_dtensor(t[key], mesh, placements, spec.shape)}

        def slicer(regions: Mapping[str, Region | None]) -> tuple[dict[str, Region | None], GroupFn]:
            # The output is the whole (distributed) tensor; what to read is this rank's box.
            if region is None:
                return {key: None}, fn
            return {key: None if is_full(region, spec.shape) else region}, sliced

        return MapperGroup((key,), {key: spec}, fn, slicer, None, "Distribute")

    def inverse(self) -> Mapper:
        return Gather(self.keys)

    def __repr__(self) -> str:
        return f"Distribute({self.mesh}, {self.placements})"


class Gather(_PerTensor):
    """DTensors -> full tensors (``full_tensor()``: a collective every rank of the mesh must join).

    Plain tensors pass unchanged. Groups run in plan order, which is the same on every rank.
    """

    def __init__(self, keys: Keys = "{*key}") -> None:
        super().__init__(keys)

    def _group(self, key: str, spec: TensorSpec) -> MapperGroup:
        def fn(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            return {key: full_tensor(t[key])}

        return MapperGroup((key,), {key: spec}, fn, None, None, "Gather")

    def __repr__(self) -> str:
        return f"Gather({self.keys})"
