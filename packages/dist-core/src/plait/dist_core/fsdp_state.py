"""FSDP2's private parameter groups, and unsharded parameters kept at fixed addresses.

FSDP2 frees a module's unsharded parameters when it reshards and allocates them again at the next
all-gather, so each all-gather may write them to new addresses. A CUDA graph of the module's forward or
backward reads its parameters at the addresses it was recorded with: :func:`keep_unsharded_storage` keeps
that memory allocated over reshards (torch's ``FSDPModule.set_keep_unsharded_storage`` where the installed
torch has it; older torch: each parameter's ``free_unsharded_param`` made a no-op, the one call through
which ``reshard`` frees it). The cost is the memory of the module's unsharded parameters, held all the
time. ``tests/dist_core/test_fsdp_state.py`` checks both paths against the installed torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch.distributed.fsdp import FSDPModule

if TYPE_CHECKING:
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

__all__ = ["keep_unsharded_storage", "param_groups"]


def param_groups(module: FSDPModule) -> list[FSDPParamGroup]:
    """The module's own FSDP2 parameter groups (empty when ``fully_shard`` gave it no parameters).

    ``_fsdp_param_groups`` in newer torch, ``_fsdp_param_group`` in torch <= 2.11.
    """
    state: Any = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [] if group is None else [group]


def _keep(_: Any = None) -> None:
    """A parameter's ``free_unsharded_param`` that frees nothing."""


def keep_unsharded_storage(module: FSDPModule) -> None:
    """Keep the unsharded parameters of ``module``'s own parameter groups allocated when it reshards.

    Every all-gather then writes them at the same addresses (what a CUDA graph of the module needs), for
    the memory of the unsharded parameters held all the time. Not recursive, like ``fully_shard``.
    """
    if hasattr(module, "set_keep_unsharded_storage"):
        module.set_keep_unsharded_storage(True, recurse=False)
        return
    for group in param_groups(module):
        for param in group.fsdp_params:
            param.free_unsharded_param = _keep  # type: ignore[method-assign]
