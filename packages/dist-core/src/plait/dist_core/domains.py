"""The five mesh domains: names of their dimensions and how ranks are laid out in them.

All domains are views of one rank layout, ``arange(world).reshape(pp, dp_replicate, dp_shard,
cp_shard, cp_replicate, tp)`` (tp innermost, pp outermost), so a rank has consistent coordinates in
every domain:

- ``regular``: ``(pp, dp_replicate, dp_shard, cp_shard, cp_replicate, tp)``, the layout itself.
- ``dense``: ``(pp, dp_replicate, dp_cp_shard, cp_replicate, tp)`` where
  ``dp_cp_shard = dp_shard * cp_shard`` (the ranks that shard dense parameters with FSDP).
- ``batch``: ``(pp, dp, cp, tp)`` with ``dp = dp_replicate * dp_shard`` and
  ``cp = cp_shard * cp_replicate`` (how the global batch is split).
- ``expert``: ``(pp, ep_replicate, ep_shard)``. ``ep_shard`` (size = expert degree) takes the
  innermost ``expert`` ranks of the data/context block ``(dp_replicate, dp_shard, cp_shard,
  cp_replicate)`` at fixed pp and tp; ``ep_replicate`` holds the remaining data/context ranks and
  the tp ranks (tensor-parallel peers hold the same experts), tp innermost.
- ``flat``: ``(world,)``.

More domains can be registered (:func:`register_mesh_domain`): a name, its dimension names and a
function that lays the ranks out for given degrees. :class:`~plait.dist_core.DistributedContext` builds a
mesh for every registered domain.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
from plait.dist_core.mesh_params import DeviceMeshParameters

Domain = Literal["regular", "dense", "expert", "batch", "flat"]

DOMAIN_DIMS: dict[str, tuple[str, ...]] = {
    "regular": ("pp", "dp_replicate", "dp_shard", "cp_shard", "cp_replicate", "tp"),
    "dense": ("pp", "dp_replicate", "dp_cp_shard", "cp_replicate", "tp"),
    "expert": ("pp", "ep_replicate", "ep_shard"),
    "batch": ("pp", "dp", "cp", "tp"),
    "flat": ("world",),
}


# The five built-in domains; registered ones add to DOMAIN_DIMS and lay their ranks out with their own function.
_BUILTIN = frozenset(DOMAIN_DIMS)
_LAYOUTS: dict[str, Callable[[DeviceMeshParameters], torch.Tensor]] = {}


def register_mesh_domain(
    name: str, dims: tuple[str, ...], layout: Callable[[DeviceMeshParameters], torch.Tensor]
) -> None:
    """Add a mesh domain: ``layout(params)`` returns the rank grid, one tensor dimension per name in ``dims``.

    Register it on every rank before :meth:`DistributedContext.from_env` (or call ``mesh_for(name)`` on
    every rank afterwards: building a mesh is a collective). Example, data-parallel ranks in one
    dimension and everything else in the other::

        register_mesh_domain("dp_rest", ("dp", "rest"),
                             lambda p: torch.arange(p.world_size).reshape(p.pipeline, p.data, -1)
                             .movedim(1, 0).reshape(p.data, -1))

    Raises:
        ValueError: the name is taken, or ``dims`` is empty or repeats a name.
    """
    if name in DOMAIN_DIMS:
        raise ValueError(f"mesh domain {name!r} already exists; registered domains: {', '.join(DOMAIN_DIMS)}")
    if not dims or len(set(dims)) != len(dims):
        raise ValueError(f"mesh domain {name!r}: dims must be distinct names, got {dims}")
    DOMAIN_DIMS[name] = tuple(dims)
    _LAYOUTS[name] = layout


def unregister_mesh_domain(name: str) -> None:
    """Remove a domain added by :func:`register_mesh_domain` (built-in domains stay)."""
    if name in _BUILTIN:
        raise ValueError(f"mesh domain {name!r} is built in and cannot be removed")
    check_domain(name)
    del DOMAIN_DIMS[name], _LAYOUTS[name]


def check_domain(domain: str) -> None:
    """Raise ``ValueError`` naming the valid domains unless ``domain`` is one of them."""
    if domain not in DOMAIN_DIMS:
        raise ValueError(f"unknown mesh domain {domain!r}; valid domains: {', '.join(DOMAIN_DIMS)}")


def domain_shape(params: DeviceMeshParameters, domain: str) -> tuple[int, ...]:
    """Sizes of the dimensions of ``domain`` (same order as ``DOMAIN_DIMS[domain]``)."""
    check_domain(domain)
    if domain in _LAYOUTS:
        return tuple(domain_layout(params, domain).shape)
    p = params
    if domain == "regular":
        return (p.pipeline, p.data_replicate, p.data_shard, p.context_shard, p.context_replicate, p.tensor)
    if domain == "dense":
        return (p.pipeline, p.data_replicate, p.data_shard * p.context_shard, p.context_replicate, p.tensor)
    if domain == "batch":
        return (p.pipeline, p.data, p.context, p.tensor)
    if domain == "expert":
        return (p.pipeline, p.data_context // p.expert * p.tensor, p.expert)
    return (p.world_size,)


def domain_layout(params: DeviceMeshParameters, domain: str) -> torch.Tensor:
    """The rank grid of ``domain``: an int64 tensor of shape ``domain_shape(params, domain)``.

    ``layout[coords]`` is the global rank at those coordinates.
    """
    if domain in _LAYOUTS:
        return _custom_layout(params, domain)
    shape = domain_shape(params, domain)
    ranks = torch.arange(params.world_size, dtype=torch.int64)
    if domain != "expert":
        return ranks.reshape(shape)
    # (pp, rest, ep, tp) -> (pp, rest, tp, ep): ep_shard is the inner data/context block, tp goes to ep_replicate.
    p = params
    grid = ranks.reshape(p.pipeline, p.data_context // p.expert, p.expert, p.tensor)
    return grid.permute(0, 1, 3, 2).reshape(shape)


def domain_coordinates(params: DeviceMeshParameters, domain: str, rank: int) -> dict[str, int]:
    """Coordinates of ``rank`` in ``domain``, keyed by dimension name."""
    layout = domain_layout(params, domain)
    if not 0 <= rank < params.world_size:
        raise ValueError(f"rank {rank} is outside the world of size {params.world_size}")
    where = (layout == rank).nonzero()[0].tolist()
    return dict(zip(DOMAIN_DIMS[domain], where, strict=True))


def domain_groups(params: DeviceMeshParameters, domain: str, dim: str) -> list[list[int]]:
    """All rank groups along ``dim`` of ``domain`` (each group: the ranks differing only in ``dim``)."""
    layout = domain_layout(params, domain)
    names = DOMAIN_DIMS[domain]
    if dim not in names:
        raise ValueError(
            f"mesh domain {domain!r} has no dimension {dim!r}; its dimensions: {', '.join(names)}"
        )
    i = names.index(dim)
    return layout.movedim(i, -1).reshape(-1, layout.shape[i]).tolist()


def _custom_layout(params: DeviceMeshParameters, domain: str) -> torch.Tensor:
    layout = torch.as_tensor(_LAYOUTS[domain](params), dtype=torch.int64)
    dims = DOMAIN_DIMS[domain]
    if layout.dim() != len(dims):
        raise ValueError(
            f"mesh domain {domain!r}: its layout has {layout.dim()} dimensions but the domain names {len(dims)} {dims}"
        )
    if sorted(layout.flatten().tolist()) != list(range(params.world_size)):
        raise ValueError(
            f"mesh domain {domain!r}: its layout must hold every rank 0..{params.world_size - 1} once, "
            f"got {layout.flatten().tolist()}"
        )
    return layout
