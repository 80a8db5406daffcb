"""Executors: run a lowered program on this rank's stages (PipelineExecutor) or all stages locally (OfflineExecutor).

The pipeline executor is a short interpreter: each entry of the rank's program is looked up in a table of
handlers (one per compute kind); communication is the :class:`~plait.pipelining.p2p.P2PLink`'s, the
forward/backward bookkeeping the :class:`~plait.pipelining.runner.StageRunner`'s, and the data-parallel
gradient reduction of FSDP2 stages the :class:`~plait.pipelining.fsdp.GradientSync`'s.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from plait.pipelining.actions import Action, ActionKind, OverlapAction
from plait.pipelining.fsdp import GradientSync
from plait.pipelining.p2p import P2PLink
from plait.pipelining.program import Program
from plait.pipelining.runner import BackwardHook, ForwardKwargsFn, LossFn, StageRunner, leaf, split_inputs
from plait.pipelining.state import PipelineState
from torch import nn

__all__ = ["OfflineExecutor", "PipelineExecutor", "PipelineStepResult", "build_forward_program"]

log = logging.getLogger(__name__)  # DEBUG: one line per compute action (hang hunting)


@dataclass(frozen=True)
class PipelineStepResult:
    """Result of one executor step. ``loss`` is set on the rank(s) holding the last stage, else None."""

    loss: torch.Tensor | None


def build_forward_program(program: Program) -> Program:
    """A forward-only program on ``program``'s topology and microbatch count (e.g. to evaluate the
    stages a training schedule placed): each rank runs its stages in order, every microbatch through one
    stage before the next."""
    topo, m = program.topology, program.num_microbatches
    acts = [
        [Action(s, ActionKind.FORWARD, i) for s in topo.stages_of(r) for i in range(m)]
        for r in range(topo.num_ranks)
    ]
    return Program.from_lists(topo, m, acts, name=f"{program.name}-forward", has_backward=False)


class PipelineExecutor:
    """Runs a lowered :class:`Program` on the stages this rank holds.

    Args:
        program: a program for `pp_group`'s size (lowered here if needed; validated).
        stage_modules: the stages this rank holds, keyed by global stage index.
        pp_group: process group of the pipeline (pp-rank = rank in this group).
        loss_fn: ``(last_stage_outputs, microbatch_view) -> scalar``; None for forward-only programs
            (the last stage's outputs are written into the state). A forward-only program with a
            ``loss_fn`` computes the losses without gradients.
        forward_kwargs_fn: optional ``(stage, microbatch_view) -> extra keyword tensors`` (not communicated).
        loss_reduction: ``"mean"`` scales each microbatch loss by ``1/num_microbatches`` before backward.
        device: device of the activations (defaults to the first parameter's device).
        on_backward: called with ``(stage, microbatch)`` when that stage's weight gradients of the
            microbatch are complete.
        fsdp_gather_once: all-gather each FSDP2 module of the stages once per step and keep its
            parameters unsharded over all microbatches (MaxText's ``all_gather_over_fsdp``); resharded at
            the step's end. Fewer all-gathers for the memory of the unsharded stages over the step.
    """

    def __init__(
        self,
        program: Program,
        stage_modules: Mapping[int, nn.Module],
        pp_group: dist.ProcessGroup,
        loss_fn: LossFn | None = None,
        *,
        forward_kwargs_fn: ForwardKwargsFn | None = None,
        loss_reduction: Literal["mean", "sum"] = "mean",
        device: torch.device | str | None = None,
        on_backward: BackwardHook | None = None,
        fsdp_gather_once: bool = False,
    ) -> None:
        from plait.pipelining.lowering import lower
        from plait.pipelining.validation import validate

        self.program = lower(program)
        validate(self.program)
        rank = dist.get_rank(pp_group)
        if dist.get_world_size(pp_group) != self.program.num_ranks:
            raise ValueError(
                f"program is for {self.program.num_ranks} pipeline ranks but pp_group has {dist.get_world_size(pp_group)}"
            )
        topo = self.program.topology
        want = set(topo.stages_of(rank))
        if set(stage_modules) != want:
            raise ValueError(
                f"pp-rank {rank} must hold stages {sorted(want)} ({topo.style} topology), got {sorted(stage_modules)}"
            )
        self.rank, self.topology = rank, topo
        self.actions = self.program.actions[rank]
        self.runner = StageRunner(
            stage_modules, topo.num_stages, loss_fn, forward_kwargs_fn, loss_reduction,
            self.program.has_backward, on_backward,
        )  # fmt: skip
        if device is None:
            p = next((p for mod in stage_modules.values() for p in mod.parameters()), None)
            device = p.device if p is not None else torch.device("cpu")
        self.device = torch.device(device)
        subs = [a for act in self.actions for a in act.sub_actions()]
        backwards = (ActionKind.BACKWARD, ActionKind.BACKWARD_WEIGHT)
        self._last_backward = {a.stage: a for a in subs if a.kind in backwards}
        # split backward (I then W) on this rank: the graph is kept between the two
        self.splits_backward = any(a.kind is ActionKind.BACKWARD_WEIGHT for a in subs)
        self.grad_sync = GradientSync(
            stage_modules,
            has_backward=self.program.has_backward,
            splits_backward=self.splits_backward,
            schedule=self.program.name,
            gather_once=fsdp_gather_once,
        )
        self.link = P2PLink(pp_group, topo, self.runner, self.device)
        self.link.connect()
        self._handlers: dict[ActionKind, Callable[[Action], None]] = {
            ActionKind.FORWARD: self._forward,
            ActionKind.BACKWARD: self._backward,
            ActionKind.BACKWARD_INPUT: self._backward_input,
            ActionKind.BACKWARD_WEIGHT: self._backward_weight,
        }
        self._steps = 0
        self._lockstep = True
        self._state = PipelineState(self.num_microbatches)
        self._mb_inputs: list[dict[str, torch.Tensor]] | None = None
        self._posted_early: set[int] = set()

    @property
    def num_microbatches(self) -> int:
        """Microbatches per step."""
        return self.program.num_microbatches

    def step(
        self,
        inputs: Mapping[str, torch.Tensor] | None,
        state: PipelineState,
        *,
        new_shapes: bool = False,
    ) -> PipelineStepResult:
        """Run forward (and backward) of every microbatch of the step.

        Args:
            inputs: keyword tensors of the first stage for the whole step (split along dim 0); only read on
                the rank holding stage 0 (empty when ``forward_kwargs_fn`` gives stage 0 its inputs).
            state: the step's :class:`PipelineState` (same num_microbatches); receives ``loss`` per microbatch
                (and the last stage's outputs for forward-only programs without ``loss_fn``).
            new_shapes: exchange the stages' output metadata (keys, dtypes, shapes) again; pass the same
                value on every pp-rank. The first step always does; later steps reuse it.

        A step that exchanges metadata also runs in lockstep: each communication group is waited for on the
        host before going on, so that no transfer is in flight while this rank computes. The first launch
        of a kernel (a new Triton specialisation, a lazily loaded or JIT-compiled CUDA kernel), which new
        shapes bring, waits for the GPU's in-flight NCCL operations; with the peer blocked the same way the
        pipeline would deadlock (measured on 2 H200s, see benchmarks/pipelining/module_load_probe.py).
        Lockstep cannot deadlock a validated program (the validator's dry run checks both modes).
        """
        m = self.num_microbatches
        if state.num_microbatches != m:
            raise ValueError(f"state has {state.num_microbatches} microbatches but the schedule has {m}")
        self._lockstep = self._steps == 0 or new_shapes
        self._steps += 1
        self._state = state
        self._mb_inputs = split_inputs(inputs, m) if inputs is not None and 0 in self.runner.modules else None
        self._posted_early.clear()
        self.runner.reset()
        self.link.begin_step(self._lockstep)
        self.grad_sync.start()
        for i, act in enumerate(self.actions):
            if act.is_comm:
                if i not in self._posted_early:
                    self.link.issue(act.sub_actions())
            elif isinstance(act, OverlapAction):
                self._overlap(act, i)
            else:
                assert isinstance(act, Action)
                log.debug("pp-rank %d computes %s", self.rank, act)
                self._handlers[act.kind](act)
        self.link.end_step()
        self.grad_sync.finish()
        self.runner.reset()
        return PipelineStepResult(self.runner.step_loss(state))

    def _overlap(self, act: OverlapAction, idx: int) -> None:
        # Forward first while the backward's gradient receive is still in flight; then post the next
        # communication group (the forward's activation send) so it travels while the backward computes.
        log.debug("pp-rank %d computes %s", self.rank, act)
        self._forward(act.forward)
        nxt = self.actions[idx + 1] if idx + 1 < len(self.actions) else None
        if nxt is not None and nxt.is_comm and not self._lockstep and self.link.ready(nxt):
            self.link.issue(nxt.sub_actions())
            self._posted_early.add(idx + 1)
        self._handlers[act.backward.kind](act.backward)

    def _forward(self, a: Action) -> None:
        s, k, r = a.stage, a.microbatch, self.runner
        if s == 0:
            if self._mb_inputs is None:
                raise ValueError(f"pp-rank {self.rank} holds stage 0 and needs `inputs` in step()")
            inputs = {key: v.to(self.device) for key, v in self._mb_inputs[k].items()}
        elif self.topology.is_local_edge(s - 1):
            prev = r.outputs[(s - 1, k)]
            inputs = {key: leaf(v, v.requires_grad and r.has_backward) for key, v in prev.items()}
        else:
            bufs, rg = self.link.activations(s, k)
            inputs = {key: leaf(v, rg[key] and r.has_backward) for key, v in bufs.items()}
        r.forward(s, k, inputs, self._state)
        if s > 0 and self.topology.is_local_edge(s - 1) and not r.has_backward:
            r.outputs.pop((s - 1, k), None)

    def _output_grads(self, a: Action) -> None:
        """Make the gradients of stage ``a.stage``'s outputs available (from the next stage or the link)."""
        s, k = a.stage, a.microbatch
        if s == self.topology.num_stages - 1:
            return
        if self.topology.is_local_edge(s):
            self.runner.output_grads[(s, k)] = self.runner.input_grads.pop((s + 1, k))
        else:
            self.link.wait_output_grads(s, k)

    def _backward(self, a: Action) -> None:
        self._output_grads(a)
        self.grad_sync.before_backward(a.stage, self._last_backward.get(a.stage) == a)
        self.runner.backward(a.stage, a.microbatch, self.num_microbatches)

    def _backward_input(self, a: Action) -> None:
        self._output_grads(a)
        self.runner.backward_input(a.stage, a.microbatch, self.num_microbatches)

    def _backward_weight(self, a: Action) -> None:
        self.grad_sync.before_backward(a.stage, self._last_backward.get(a.stage) == a)
        self.runner.backward_weight(a.stage, a.microbatch)


class OfflineExecutor:
    """pp=1 executor with the same :meth:`step` as :class:`PipelineExecutor`: stages chained on one process.

    Data-parallel gradient reduction of FSDP2 / ``replicate``-d stage modules runs in the last
    microbatch's backward only.

    Args:
        stage_modules: every stage, keyed 0..n-1, run in order.
        loss_fn: ``(last_stage_outputs, microbatch_view) -> scalar``; None runs forward only.
        num_microbatches: microbatches per step (gradient accumulation).
        forward_kwargs_fn: optional extra keyword tensors per (stage, microbatch).
        loss_reduction: ``"mean"`` or ``"sum"`` as for :class:`PipelineExecutor`.
        forward_only: compute the losses without gradients (evaluation).
        on_backward: called with ``(stage, microbatch)`` after each backward.
        fsdp_gather_once: as for :class:`PipelineExecutor`: each FSDP2 module all-gathered once per step.
    """

    def __init__(
        self,
        stage_modules: Mapping[int, nn.Module],
        loss_fn: LossFn | None,
        num_microbatches: int,
        *,
        forward_kwargs_fn: ForwardKwargsFn | None = None,
        loss_reduction: Literal["mean", "sum"] = "mean",
        forward_only: bool = False,
        on_backward: BackwardHook | None = None,
        fsdp_gather_once: bool = False,
    ) -> None:
        if sorted(stage_modules) != list(range(len(stage_modules))) or not stage_modules:
            raise ValueError(f"OfflineExecutor needs stages 0..n-1, got {sorted(stage_modules)}")
        if num_microbatches < 1:
            raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
        self.num_microbatches = num_microbatches
        has_backward = loss_fn is not None and not forward_only
        self.runner = StageRunner(
            stage_modules,
            len(stage_modules),
            loss_fn,
            forward_kwargs_fn,
            loss_reduction,
            has_backward,
            on_backward,
        )
        self.grad_sync = GradientSync(
            stage_modules,
            has_backward=has_backward,
            splits_backward=False,
            schedule="offline",
            finalize=False,
            gather_once=fsdp_gather_once,
        )

    def step(self, inputs: Mapping[str, torch.Tensor] | None, state: PipelineState) -> PipelineStepResult:
        """Forward (and backward) every microbatch through all stages; gradients accumulate."""
        m, r = self.num_microbatches, self.runner
        if state.num_microbatches != m:
            raise ValueError(f"state has {state.num_microbatches} microbatches but the executor has {m}")
        if inputs is None:
            raise ValueError("OfflineExecutor.step needs the first stage's inputs")
        mbs = split_inputs(inputs, m)
        r.reset()
        self.grad_sync.start()
        n = r.num_stages
        for k in range(m):
            x: dict[str, torch.Tensor] = mbs[k]
            for s in range(n):
                r.forward(s, k, x, state)
                if s < n - 1:
                    x = {
                        key: leaf(v, v.requires_grad and r.has_backward)
                        for key, v in r.outputs[(s, k)].items()
                    }
            if r.has_backward:
                for s in reversed(range(n)):
                    if s < n - 1:
                        r.output_grads[(s, k)] = r.input_grads.pop((s + 1, k))
                    self.grad_sync.before_backward(s, k == m - 1)
                    r.backward(s, k, m)
            r.reset()
        self.grad_sync.finish()
        return PipelineStepResult(r.step_loss(state))
