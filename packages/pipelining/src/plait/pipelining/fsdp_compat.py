"""Every use of FSDP2's private state in plait.pipelining, in one place.

``gather_once`` keeps an FSDP2 module's parameters unsharded after forward by clearing each parameter
group's ``post_forward_mesh_info`` (what ``fully_shard(reshard_after_forward=False)`` sets) and later
restores it. FSDP2 exposes no public switch for this after ``fully_shard``, so these functions read and
write its private state: ``FSDPModule._get_fsdp_state()``, the state's parameter groups
(:func:`plait.dist_core.fsdp_state.param_groups`), ``_is_root``,
``_auto_reshard_after_forward`` and the group's ``post_forward_mesh_info``.
``tests/pipelining/test_fsdp_compat.py`` checks this contract against the installed torch and fails
naming what changed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from plait.dist_core.fsdp_state import param_groups
from torch.distributed.fsdp import FSDPModule

if TYPE_CHECKING:
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

__all__ = ["PostForward", "keep_unsharded_after_forward", "post_forward_settings", "restore_post_forward"]

# A parameter group and where it reshards after forward (None: it keeps the unsharded parameters).
PostForward = tuple["FSDPParamGroup", "FSDPMeshInfo | None"]


def _state(module: FSDPModule) -> Any:
    return module._get_fsdp_state()


def post_forward_settings(module: FSDPModule) -> list[PostForward]:
    """Each parameter group of ``module`` with where it reshards after forward now."""
    return [(g, g.post_forward_mesh_info) for g in param_groups(module)]


def keep_unsharded_after_forward(module: FSDPModule) -> None:
    """No parameter group of ``module`` reshards after forward until :func:`restore_post_forward`."""
    for group in param_groups(module):
        group.post_forward_mesh_info = None


def restore_post_forward(module: FSDPModule, setting: PostForward) -> None:
    """Give a parameter group of ``module`` back its configured post-forward resharding.

    torch's lazy init (at the first forward, possibly after :func:`post_forward_settings` read the
    setting) keeps a root's parameters after forward unless ``reshard_after_forward`` was given (torch
    <= 2.11: always), so the same rule applies here.
    """
    group, configured = setting
    state = _state(module)
    keeps = state._is_root and getattr(state, "_auto_reshard_after_forward", True)
    group.post_forward_mesh_info = None if keeps else configured
