"""The trainer's records: its checkpointed counters and the result of one step."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["StepResult", "TrainerState"]


class TrainerState:
    """The trainer's own counters, as a ``Stateful`` (step, skipped steps, tokens, tracker run ids)."""

    def __init__(self) -> None:
        self.step = 0
        self.skipped_steps = 0
        self.tokens_seen = 0
        self.tracker_run_ids: dict[str, str] = {}

    def state_dict(self) -> dict[str, Any]:
        """Plain values."""
        return {
            "step": self.step,
            "skipped_steps": self.skipped_steps,
            "tokens_seen": self.tokens_seen,
            "tracker_run_ids": dict(self.tracker_run_ids),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the counters."""
        self.step = int(state["step"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.tokens_seen = int(state.get("tokens_seen", 0))
        # in place: the run reporter holds this mapping (it reuses a resumed tracker's run id)
        ids = dict(state.get("tracker_run_ids", {}))
        self.tracker_run_ids.clear()
        self.tracker_run_ids.update(ids)


class StepResult:
    """What one :meth:`Trainer.train_step` did (global values, identical on every rank)."""

    __slots__ = ("global_tokens", "grad_norm", "loss", "lr", "skipped")

    def __init__(self, loss: float, grad_norm: float, lr: float, global_tokens: int, skipped: bool) -> None:
        self.loss, self.grad_norm, self.lr = loss, grad_norm, lr
        self.global_tokens, self.skipped = global_tokens, skipped

    def __repr__(self) -> str:
        return (
            f"StepResult(loss={self.loss:.6g}, grad_norm={self.grad_norm:.6g}, lr={self.lr:.3g}, "
            f"global_tokens={self.global_tokens}, skipped={self.skipped})"
        )
