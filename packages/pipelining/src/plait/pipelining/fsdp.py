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

from plait.dist_core import is_replicated, set_gradient_sync
from plait.pipelining import fsdp_compat
from torch import nn
from torch.distributed.fsdp import FSDPModule

__all__ = ["GradientSync"]


def _switchable(module: nn.Module) -> bool:
    return isinstance(module, FSDPModule) or is_replicated(module)


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
                "torch's FSDPModule.finalize_backward (not in this torch version); use a schedule with full "
                "backward passes (no I/W actions, e.g. '1f1b') or a newer torch"
            )
        fsdp = [sub for m in stage_modules.values() for sub in m.modules() if isinstance(sub, FSDPModule)]
        # Split backward: the W pass differentiates w.r.t. the parameters a stage holds at its I pass. An FSDP2
        # submodule resharded after a later microbatch's forward holds its sharded parameters then, not the
        # unsharded ones that microbatch's forward used, and those weight gradients would be lost; so these
        # schedules keep the parameters gathered too (reshard-after-backward is off over their step anyway).
        self.gathered = fsdp if gather_once or (splits_backward and has_backward) else []
        # per gathered module, over a step: its parameter groups and where each reshards after forward
        self._configured: dict[FSDPModule, list[fsdp_compat.PostForward]] = {}

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
                set_gradient_sync(m, False, recurse=False)

    def before_backward(self, stage: int, last: bool) -> None:
        """Before a backward of ``stage``; ``last``: the stage's last backward of the step."""
        if self.manual:
            return
        for m in self.switched.get(stage, ()):
            set_gradient_sync(m, last, recurse=False)
        root = self.roots.get(stage)
        if root is not None and self.finalize:
            root.set_is_last_backward(last)

    def finish(self) -> None:
        """After the step's last backward: reduce what was accumulated, reshard what was kept gathered and
        reset the modules."""
        for subs in self.switched.values():
            for m in subs:
                set_gradient_sync(m, True, recurse=False)
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
            if m not in self._configured:
                self._configured[m] = fsdp_compat.post_forward_settings(m)
            fsdp_compat.keep_unsharded_after_forward(m)
            m.set_reshard_after_backward(False, recurse=False)

    def _reshard(self) -> None:
        """``gather_once``, at the step's end: free the unsharded parameters, restore the configuration."""
        for m in self.gathered:
            m.set_reshard_after_backward(True, recurse=False)
            m.reshard()
        for module, settings in self._configured.items():
            for setting in settings:
                fsdp_compat.restore_post_forward(module, setting)
        self._configured.clear()
