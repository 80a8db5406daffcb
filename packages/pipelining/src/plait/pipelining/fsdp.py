"""When the data-parallel gradient reduction of FSDP2 (or plait.dist_core ``replicate``) stage modules runs.

Over a step the stages accumulate unreduced gradients; the reduction runs once, after the step's last
backward. The pipeline executor uses torch's manual backward finalisation
(``FSDPModule.finalize_backward``) and finalises at the end of the step, which split backward needs
(FSDP's own post-backward hook would fire during the ``I`` pass, before ``W`` produced any weight
gradient). Otherwise (the offline executor, or an older torch) FSDP reduces in the post-backward of each
stage's last backward of the step.
"""

from __future__ import annotations

from collections.abc import Mapping

from plait.dist_core import set_gradient_sync
from torch import nn
from torch.distributed.fsdp import FSDPModule

__all__ = ["GradientSync"]


def _switchable(module: nn.Module) -> bool:
    return isinstance(module, FSDPModule) or getattr(module, "_plait_replicate", None) is not None


class GradientSync:
    """Switches gradient reduction of the stage modules off during a step and runs it once at its end.

    Args:
        stage_modules: the stages of this process, by global index (FSDP2 modules at any depth and
            ``replicate``-d submodules are switched).
        has_backward: whether the schedule runs backward passes (forward-only steps change nothing).
        splits_backward: whether the schedule splits backward into input and weight passes.
        schedule: the schedule's name, for the error message.
        finalize: finalise FSDP2 roots manually at the end of the step where torch supports it
            (parameters stay unsharded over the step); False switches only the reduction, per backward.

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

    def start(self) -> None:
        """Before the step's first backward: accumulate unreduced gradients."""
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
        """After the step's last backward: reduce what was accumulated and reset the modules."""
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
