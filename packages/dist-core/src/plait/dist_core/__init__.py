"""plait.dist_core: device meshes, distributed context, seeding, collectives, pytree sharding,
the load-balanced context-parallel sequence layout,
parallelize applicators, DTensor-aware gradient clipping. The test harness is
:mod:`plait.dist_core.testing`."""

import importlib
from typing import TYPE_CHECKING, Any

from plait.dist_core.collectives import all_gather_object, all_gather_uneven, gather_uneven, reduce_scalar
from plait.dist_core.context import DistributedContext, release_cuda_graphs
from plait.dist_core.context_parallel import (
    gather_sequence,
    load_balanced_indices,
    shard_batch,
    shard_sequence,
    unshard_sequence,
)
from plait.dist_core.domains import (
    DOMAIN_DIMS,
    Domain,
    domain_coordinates,
    domain_groups,
    domain_layout,
    register_mesh_domain,
    unregister_mesh_domain,
)
from plait.dist_core.dtypes import dtype_name, parse_dtype
from plait.dist_core.mesh_params import DeviceMeshParameters
from plait.dist_core.pytree import ShardSpec, TensorSplit, Whole, shard_tree, split_sizes, unshard_tree
from plait.dist_core.seeding import SeedKind, init_as_one_process, seed_for, seed_from_coordinates, set_seed

if TYPE_CHECKING:
    from plait.dist_core.grad_norm import clip_factor, clip_grad_norm_, global_grad_norm
    from plait.dist_core.parallelize import (
        all_reduce_grads,
        data_parallel_mesh,
        fully_shard_module,
        is_replicated,
        prefetch_all_gathers,
        replicate,
        replicated_reduce,
        set_gradient_sync,
    )

# DTensor/FSDP (torch.distributed.tensor pulls in sympy: seconds) load on first use, so code that
# only needs meshes and the context imports fast.
_LAZY = {
    "clip_factor": "plait.dist_core.grad_norm",
    "clip_grad_norm_": "plait.dist_core.grad_norm",
    "global_grad_norm": "plait.dist_core.grad_norm",
    "all_reduce_grads": "plait.dist_core.parallelize",
    "data_parallel_mesh": "plait.dist_core.parallelize",
    "fully_shard_module": "plait.dist_core.parallelize",
    "is_replicated": "plait.dist_core.parallelize",
    "prefetch_all_gathers": "plait.dist_core.parallelize",
    "replicate": "plait.dist_core.parallelize",
    "replicated_reduce": "plait.dist_core.parallelize",
    "set_gradient_sync": "plait.dist_core.parallelize",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'plait.dist_core' has no attribute {name!r}")


__all__ = [
    "DOMAIN_DIMS",
    "DeviceMeshParameters",
    "DistributedContext",
    "Domain",
    "SeedKind",
    "ShardSpec",
    "TensorSplit",
    "Whole",
    "all_gather_object",
    "all_gather_uneven",
    "all_reduce_grads",
    "clip_factor",
    "clip_grad_norm_",
    "data_parallel_mesh",
    "domain_coordinates",
    "domain_groups",
    "domain_layout",
    "dtype_name",
    "fully_shard_module",
    "gather_sequence",
    "gather_uneven",
    "global_grad_norm",
    "init_as_one_process",
    "is_replicated",
    "load_balanced_indices",
    "parse_dtype",
    "prefetch_all_gathers",
    "reduce_scalar",
    "register_mesh_domain",
    "release_cuda_graphs",
    "replicate",
    "replicated_reduce",
    "seed_for",
    "seed_from_coordinates",
    "set_gradient_sync",
    "set_seed",
    "shard_batch",
    "shard_sequence",
    "shard_tree",
    "split_sizes",
    "unregister_mesh_domain",
    "unshard_sequence",
    "unshard_tree",
]
