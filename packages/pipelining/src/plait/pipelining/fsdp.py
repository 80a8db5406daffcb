"""When the data-parallel gradient reduction of FSDP2 (or plait.dist_core ``replicate``) stage modules runs,
and how often their parameters are all-gathered.

Over a step the stages accumulate unreduced gradients; the reduction runs once, after the step's last
backward. The pipeline executor uses torch's manual backward finalisation
(``FSDPModule.finalize_backward``) and finalises at the end of the step, which split backward needs
(FSDP's own post-backward hook would fire during the ``I`` pass, before ``W`` produced any weight
gradient). Otherwise (the offline executor, or an older torch) FSDP reduces in the post-backward of each
stage's last backward of the step.

With ``gather_once`` (MaxText's ``all_gather_over_fsdp``) every FSDP2 module of the stages keeps its
parameters unsharded from its first all-gather of the step to the step's end (no resharding after
forward or backward), so each module is all-gathered once per step instead of once or twice per
microbatch; the step ends by resharding them all (before the optimizer updates the sharded parameters)
and restoring each module's own ``reshard_after_forward``. It trades the memory of the unsharded stages
(held over the whole step) for fewer all-gathers. Split-backward schedules always keep the parameters
gathered: their ``W`` pass needs the parameters the forward used.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from plait.dist_core import set_gradient_sync
from torch import nn
from torch.distributed.fsdp import FSDPModule

if TYPE_CHECKING:
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

__all__ = ["GradientSync"]


def _param_groups(state: FSDPState) -> list[FSDPParamGroup]:
    """The module's FSDP2 parameter groups: a list in newer torch, one optional group in torch <= 2.11."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [] if group is None else [group]


def _switchable(module: nn.Module) -> bool:
    return isinstance(module, FSDPModule) or getattr(module, "_plait_replicate", None) is not None


class GradientSync:
    """Switches gradient reduction of the stage modules off during a step and runs it once at its end.

    Args:
        stage_modules: the stages of this process, by global index (FSDP2 modules at any depth and
            ``replicate``-d submodules are switched).
        has_backward: whether the schedule runs backward passes (forward-only steps change nothing
            but ``gather_once``).
        splits_backward: whether the schedule splits backward into input and weight passes.
        schedule: the schedule's name, for the error message.
        finalize: finalise FSDP2 roots manually at the end of the step where torch supports it
            (parameters stay unsharded over the step); False switches only the reduction, per backward.
        gather_once: all-gather each FSDP2 module's parameters once per step and keep them unsharded
            over all its microbatches (forward-only steps too); they are resharded at the step's end.
            Split-backward schedules always do (see the comment in the body).

    Raises:
        RuntimeError: a split-backward schedule over FSDP2 stages without manual finalisation.
    """

    def __init__(
        self,
        stage_modules: Mapping[int, nn.Module],
        *,
        has_backward: bool,
        splits_backward: bool,
        schedule: str,
        finalize: bool = True,
        gather_once: bool = False,
    ) -> None:
        self.roots = {s: m for s, m in stage_modules.items() if isinstance(m, FSDPModule)}
        self.switched = {
            s: [sub for sub in m.modules() if _switchable(sub)] for s, m in stage_modules.items()
        }
        self.active = has_backward
        self.finalize = finalize
        self.manual = (
            has_backward
            and finalize
            and bool(self.roots)
            and all(hasattr(m, "finalize_backward") for m in self.roots.values())
        )
        if self.roots and splits_backward and not self.manual:
            raise RuntimeError(
                f"schedule {schedule!r} splits the backward (I/W), which with FSDP2 stage modules needs "
                "torch's FSDPModule.finalize_backward (not in this torch version); use a full-backward schedule "
                "(gpipe, 1f1b, looped_bfs, interleaved_1f1b) or a newer torch"
            )
        fsdp = [sub for m in stage_modules.values() for sub in m.modules() if isinstance(sub, FSDPModule)]
        # Split backward: the W pass differentiates w.r.t. the parameters a stage holds at its I pass. An FSDP2
        # submodule resharded after a later microbatch's forward holds its sharded parameters then, not the
        # unsharded ones that microbatch's forward used, and those weight gradients would be lost; so these
        # schedules keep the parameters gathered too (reshard-after-backward is off over their step anyway).
        self.gathered = fsdp if gather_once or (splits_backward and has_backward) else []
        # per parameter group of the gathered modules, over a step: its state and where it reshards after
        # forward (FSDP's private record of reshard_after_forward: None keeps the parameters unsharded)
        self._configured: dict[FSDPParamGroup, tuple[FSDPState, FSDPMeshInfo | None]] = {}

    def start(self) -> None:
        """Before the step's first forward: keep gathered parameters; accumulate unreduced gradients."""
        self._keep_unsharded()
        if not self.active:
            return
        for root in self.roots.values() if self.manual else ():
            root.set_manual_backward_finalization(True)
            root.set_reshard_after_backward(False)
        for subs in self.switched.values():
            for m in subs:
                set_gradient_sync(m, False)

    def before_backward(self, stage: int, last: bool) -> None:
        """Before a backward of ``stage``; ``last``: the stage's last backward of the step."""
        if self.manual:
            return
        for m in self.switched.get(stage, ()):
            set_gradient_sync(m, last)
        root = self.roots.get(stage)
        if root is not None and self.finalize:
            root.set_is_last_backward(last)

    def finish(self) -> None:
        """After the step's last backward: reduce what was accumulated, reshard what was kept gathered and
        reset the modules."""
        for subs in self.switched.values():
            for m in subs:
                set_gradient_sync(m, True)
        for m in self.roots.values():
            if self.manual:
                m.set_reshard_after_backward(True)
                m.finalize_backward()
                m.set_manual_backward_finalization(False)
            else:
                m.set_is_last_backward(True)
        self._reshard()

    def _keep_unsharded(self) -> None:
        """``gather_once``: no module reshards after forward or backward until :meth:`_reshard`."""
        for m in self.gathered:
            state = m._get_fsdp_state()
            for group in _param_groups(state):
                if group not in self._configured:
                    self._configured[group] = (state, group.post_forward_mesh_info)
                group.post_forward_mesh_info = None  # what fully_shard(reshard_after_forward=False) sets
            m.set_reshard_after_backward(False, recurse=False)

    def _reshard(self) -> None:
        """``gather_once``, at the step's end: free the unsharded parameters, restore the configuration."""
        for m in self.gathered:
            m.set_reshard_after_backward(True, recurse=False)
            m.reshard()
        for group, (state, configured) in self._configured.items():
            # torch's lazy init (at the first forward, possibly within this step) keeps a root's
            # parameters after forward unless reshard_after_forward was given (torch <= 2.11: always):
            # apply that rule here too
            group.post_forward_mesh_info = (
                None if state._is_root and getattr(state, "_auto_reshard_after_forward", True) else configured
            )
        self._configured.clear()
