"""The stage runner: forward/backward bookkeeping of the stages one process holds (both executors use it)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal

import torch
from plait.pipelining.split_backward import WeightGradWork, backward_input, backward_weight
from plait.pipelining.state import MicrobatchView, PipelineState
from torch import nn

__all__ = ["BackwardHook", "ForwardKwargsFn", "LossFn", "StageRunner", "split_inputs"]

LossFn = Callable[[dict[str, torch.Tensor], MicrobatchView], torch.Tensor]
ForwardKwargsFn = Callable[[int, MicrobatchView], Mapping[str, torch.Tensor]]
# (stage, microbatch) after the backward that completes the stage's weight gradients for that microbatch.
BackwardHook = Callable[[int, int], None]
Key = tuple[int, int]  # (stage, microbatch)


def split_inputs(inputs: Mapping[str, torch.Tensor], m: int) -> list[dict[str, torch.Tensor]]:
    """Split every input along dim 0 into ``m`` equal microbatches."""
    out: list[dict[str, torch.Tensor]] = [{} for _ in range(m)]
    for k, v in inputs.items():
        if not isinstance(v, torch.Tensor) or v.dim() == 0:
            raise ValueError(f"pipeline input {k!r} must be a tensor with a batch dimension")
        if v.shape[0] % m != 0:
            raise ValueError(
                f"pipeline input {k!r}: batch size {v.shape[0]} is not divisible by num_microbatches={m}"
            )
        for i, part in enumerate(v.chunk(m, dim=0)):
            out[i][k] = part
    return out


def leaf(t: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    """``t`` detached as a new autograd leaf (a stage input)."""
    return t.detach().requires_grad_(requires_grad and t.is_floating_point())


def _as_outputs(stage: int, out: Any) -> dict[str, torch.Tensor]:
    if not isinstance(out, Mapping) or not all(isinstance(v, torch.Tensor) for v in out.values()):
        raise TypeError(f"stage {stage}'s module must return dict[str, Tensor], got {type(out).__name__}")
    if not out:
        raise ValueError(f"stage {stage}'s module returned an empty dict")
    return dict(out)


class StageRunner:
    """Runs forward, backward (full or split into input/weight passes) of the stages a process holds.

    It keeps each (stage, microbatch)'s inputs, outputs and gradients until they are consumed; the
    executors decide the order and move tensors between stages.

    Args:
        stage_modules: the stages held here, keyed by global stage index.
        num_stages: stages of the whole pipeline (the last one computes the loss).
        loss_fn: ``(last_stage_outputs, microbatch_view) -> scalar``; None writes the last stage's
            outputs into the state instead (forward only).
        forward_kwargs_fn: extra keyword tensors of ``(stage, microbatch_view)`` (not communicated).
        loss_reduction: ``"mean"`` scales each microbatch loss by ``1/num_microbatches`` before backward.
        has_backward: whether the schedule runs backward passes (False: forward under ``no_grad``).
        on_backward: called with ``(stage, microbatch)`` once that stage's weight gradients of the
            microbatch are complete.
    """

    def __init__(
        self,
        stage_modules: Mapping[int, nn.Module],
        num_stages: int,
        loss_fn: LossFn | None,
        forward_kwargs_fn: ForwardKwargsFn | None,
        loss_reduction: Literal["mean", "sum"],
        has_backward: bool,
        on_backward: BackwardHook | None = None,
    ) -> None:
        if has_backward and loss_fn is None:
            raise ValueError(
                "a training schedule needs loss_fn (pass an inference schedule to run forward only)"
            )
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
        self.modules = dict(stage_modules)
        self.num_stages = num_stages
        self.loss_fn = loss_fn
        self.forward_kwargs_fn = forward_kwargs_fn
        self.loss_reduction = loss_reduction
        self.has_backward = has_backward
        self.on_backward = on_backward
        self.inputs: dict[Key, dict[str, torch.Tensor]] = {}
        self.outputs: dict[Key, dict[str, torch.Tensor]] = {}
        self.losses: dict[int, torch.Tensor] = {}
        self.input_grads: dict[Key, dict[str, torch.Tensor]] = {}
        self.output_grads: dict[Key, dict[str, torch.Tensor]] = {}
        self.weight_work: dict[Key, WeightGradWork] = {}

    def reset(self) -> None:
        """Drop everything kept from the last step."""
        for d in (
            self.inputs,
            self.outputs,
            self.losses,
            self.input_grads,
            self.output_grads,
            self.weight_work,
        ):
            d.clear()

    def module(self, stage: int) -> nn.Module:
        """The module of ``stage`` (KeyError naming the held stages otherwise)."""
        if stage not in self.modules:
            raise KeyError(f"stage {stage} is not held by this rank (held: {sorted(self.modules)})")
        return self.modules[stage]

    def forward(self, stage: int, mb: int, inputs: dict[str, torch.Tensor], state: PipelineState) -> None:
        """Forward ``stage`` on microbatch ``mb`` (the last stage also computes the loss)."""
        view = state.microbatch(mb)
        extra = dict(self.forward_kwargs_fn(stage, view)) if self.forward_kwargs_fn else {}
        with torch.set_grad_enabled(self.has_backward):
            out = _as_outputs(stage, self.module(stage)(**inputs, **extra))
            if stage == self.num_stages - 1:
                if self.loss_fn is None:
                    for k, v in out.items():
                        view[k] = v.detach()
                else:
                    loss = self.loss_fn(out, view)
                    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                        raise ValueError("loss_fn must return a scalar tensor")
                    self.losses[mb] = loss
                    view["loss"] = loss.detach().reshape(())
        if self.has_backward:
            self.inputs[(stage, mb)] = inputs
        if stage < self.num_stages - 1 or self.has_backward:
            self.outputs[(stage, mb)] = out

    def _roots(self, stage: int, mb: int, num_microbatches: int) -> tuple[list[torch.Tensor], list[Any]]:
        if stage == self.num_stages - 1:
            loss = self.losses[mb]
            if self.loss_reduction == "mean":
                loss = loss / num_microbatches
            return [loss.reshape(())], [None]
        out = self.outputs[(stage, mb)]
        grads = self.output_grads.pop((stage, mb))
        roots = [(v, grads[k]) for k, v in sorted(out.items()) if v.requires_grad and k in grads]
        return [r for r, _ in roots], [g for _, g in roots]

    def _record_input_grads(self, stage: int, mb: int, grads: Mapping[str, torch.Tensor | None]) -> None:
        inputs = self.inputs[(stage, mb)]
        self.input_grads[(stage, mb)] = {
            k: (g if g is not None else torch.zeros_like(inputs[k]))
            for k, g in grads.items()
            if inputs[k].requires_grad
        }

    def backward(self, stage: int, mb: int, num_microbatches: int) -> None:
        """Full backward (input and weight gradients) of ``stage`` on ``mb``."""
        roots, grads = self._roots(stage, mb, num_microbatches)
        inputs = self.inputs[(stage, mb)]
        if roots:
            torch.autograd.backward(roots, grads)
        self._record_input_grads(stage, mb, {k: v.grad for k, v in inputs.items()})
        self.outputs.pop((stage, mb), None)
        self.inputs.pop((stage, mb), None)
        if stage == self.num_stages - 1:
            self.losses.pop(mb, None)
        if self.on_backward is not None:
            self.on_backward(stage, mb)

    def backward_input(self, stage: int, mb: int, num_microbatches: int) -> None:
        """Input gradients only; the graph is kept for :meth:`backward_weight`."""
        roots, grads = self._roots(stage, mb, num_microbatches)
        inputs = self.inputs[(stage, mb)]
        keys = sorted(inputs)
        params = [p for p in self.module(stage).parameters() if p.requires_grad]
        got, work = backward_input(roots, grads, [inputs[k] for k in keys], params)
        self.weight_work[(stage, mb)] = work
        self._record_input_grads(stage, mb, dict(zip(keys, got)))
        self.outputs.pop((stage, mb), None)
        if stage == self.num_stages - 1:
            self.losses.pop(mb, None)

    def backward_weight(self, stage: int, mb: int) -> None:
        """Weight gradients of an earlier :meth:`backward_input`."""
        backward_weight(self.weight_work.pop((stage, mb)))
        self.inputs.pop((stage, mb), None)
        if self.on_backward is not None:
            self.on_backward(stage, mb)

    def step_loss(self, state: PipelineState) -> torch.Tensor | None:
        """The step's loss (mean or sum of the microbatch losses) where the last stage is held."""
        if self.num_stages - 1 not in self.modules or self.loss_fn is None:
            return None
        losses = state.global_view["loss"]
        return losses.mean() if self.loss_reduction == "mean" else losses.sum()
