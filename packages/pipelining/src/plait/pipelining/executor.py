"""Executors: run a lowered program on this rank's stages (PipelineExecutor) or all stages locally (OfflineExecutor)."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from plait.pipelining.actions import Action, ActionKind, AnyAction, OverlapAction
from plait.pipelining.program import Program
from plait.pipelining.split_backward import WeightGradWork, backward_input, backward_weight
from plait.pipelining.state import MicrobatchView, PipelineState
from torch import nn

__all__ = ["LossFn", "OfflineExecutor", "PipelineExecutor", "StepResult"]

log = logging.getLogger(__name__)  # DEBUG: one line per posted group and per compute action (hang hunting)

LossFn = Callable[[dict[str, torch.Tensor], MicrobatchView], torch.Tensor]
ForwardKwargsFn = Callable[[int, MicrobatchView], Mapping[str, torch.Tensor]]
_META_BYTES = 4096
_DTYPES = {str(d): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
                                torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)}  # fmt: skip


@dataclass(frozen=True)
class StepResult:
    """Result of one :meth:`step`. ``loss`` is set on the rank(s) holding the last stage, else None."""

    loss: torch.Tensor | None


def _split_inputs(inputs: Mapping[str, torch.Tensor], m: int) -> list[dict[str, torch.Tensor]]:
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


def _as_outputs(stage: int, out: Any) -> dict[str, torch.Tensor]:
    if not isinstance(out, Mapping) or not all(isinstance(v, torch.Tensor) for v in out.values()):
        raise TypeError(f"stage {stage}'s module must return dict[str, Tensor], got {type(out).__name__}")
    if not out:
        raise ValueError(f"stage {stage}'s module returned an empty dict")
    return dict(out)


def _is_fsdp(module: nn.Module) -> bool:
    return hasattr(module, "set_requires_gradient_sync") and hasattr(module, "set_is_last_backward")


class _StageRunner:
    """Forward/backward bookkeeping of the stages a rank holds (shared by both executors)."""

    def __init__(
        self,
        stage_modules: Mapping[int, nn.Module],
        num_stages: int,
        loss_fn: LossFn | None,
        forward_kwargs_fn: ForwardKwargsFn | None,
        loss_reduction: Literal["mean", "sum"],
        has_backward: bool,
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
        self.reset()

    def reset(self) -> None:
        self.inputs: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        self.outputs: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        self.losses: dict[int, torch.Tensor] = {}
        self.input_grads: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        self.output_grads: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        self.weight_work: dict[tuple[int, int], WeightGradWork] = {}

    def module(self, stage: int) -> nn.Module:
        if stage not in self.modules:
            raise KeyError(f"stage {stage} is not held by this rank (held: {sorted(self.modules)})")
        return self.modules[stage]

    def forward(self, stage: int, mb: int, inputs: dict[str, torch.Tensor], state: PipelineState) -> None:
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
        roots, grads = self._roots(stage, mb, num_microbatches)
        inputs = self.inputs[(stage, mb)]
        if roots:
            torch.autograd.backward(roots, grads)
        self._record_input_grads(stage, mb, {k: v.grad for k, v in inputs.items()})
        self._free(stage, mb)

    def backward_input(self, stage: int, mb: int, num_microbatches: int) -> None:
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
        backward_weight(self.weight_work.pop((stage, mb)))
        self.inputs.pop((stage, mb), None)

    def _free(self, stage: int, mb: int) -> None:
        self.outputs.pop((stage, mb), None)
        self.inputs.pop((stage, mb), None)
        if stage == self.num_stages - 1:
            self.losses.pop(mb, None)

    def step_loss(self, state: PipelineState, m: int) -> torch.Tensor | None:
        if self.num_stages - 1 not in self.modules or not self.has_backward:
            return None
        losses = state.global_view["loss"]
        return losses.mean() if self.loss_reduction == "mean" else losses.sum()


def _leaf(t: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    return t.detach().requires_grad_(requires_grad and t.is_floating_point())


class PipelineExecutor:
    """Runs a lowered :class:`Program` on the stages this rank holds.

    Args:
        program: a program for `pp_group`'s size (lowered here if needed; validated).
        stage_modules: the stages this rank holds, keyed by global stage index.
        pp_group: process group of the pipeline (pp-rank = rank in this group).
        loss_fn: ``(last_stage_outputs, microbatch_view) -> scalar``; None for forward-only programs.
        forward_kwargs_fn: optional ``(stage, microbatch_view) -> extra keyword tensors`` (not communicated).
        loss_reduction: ``"mean"`` scales each microbatch loss by ``1/num_microbatches`` before backward.
        device: device of the activations (defaults to the first parameter's device).
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
    ) -> None:
        from plait.pipelining.lowering import lower
        from plait.pipelining.validation import validate

        self.program = lower(program)
        validate(self.program)
        self._steps = 0
        self.group = pp_group
        self.rank = dist.get_rank(pp_group)
        if dist.get_world_size(pp_group) != self.program.num_ranks:
            raise ValueError(
                f"program is for {self.program.num_ranks} pipeline ranks but pp_group has {dist.get_world_size(pp_group)}"
            )
        topo = self.program.topology
        want = set(topo.stages_of(self.rank))
        if set(stage_modules) != want:
            raise ValueError(
                f"pp-rank {self.rank} must hold stages {sorted(want)} ({topo.style} topology), got {sorted(stage_modules)}"
            )
        self.topology = topo
        self.runner = _StageRunner(
            stage_modules,
            topo.num_stages,
            loss_fn,
            forward_kwargs_fn,
            loss_reduction,
            self.program.has_backward,
        )
        if device is None:
            p = next((p for mod in stage_modules.values() for p in mod.parameters()), None)
            device = p.device if p is not None else torch.device("cpu")
        self.device = torch.device(device)
        self._last_backward = self._find_last_backward()
        # split backward (I then W) on this rank: the graph is kept between the two
        self.splits_backward = any(
            a.kind is ActionKind.BACKWARD_WEIGHT
            for act in self.program.actions[self.rank]
            for a in act.sub_actions()
        )
        self._connect()

    @property
    def num_microbatches(self) -> int:
        return self.program.num_microbatches

    def _find_last_backward(self) -> dict[int, Action]:
        last: dict[int, Action] = {}
        for act in self.program.actions[self.rank]:
            for a in act.sub_actions():
                if a.kind in (ActionKind.BACKWARD, ActionKind.BACKWARD_WEIGHT):
                    last[a.stage] = a
        return last

    def _peer(self, stage: int) -> int:
        return dist.get_global_rank(self.group, self.topology.rank_of(stage))

    def _connect(self) -> None:
        """Create the communicator and open the connections to the pipeline neighbours (a collective call).

        NCCL does both lazily, inside the call that first needs them, and that call blocks until the peer
        joins. Done here, every pp-rank joins at the same point and no step waits on it.
        """
        me = dist.get_rank()
        topo = self.topology
        peers = sorted(
            {
                self._peer(s + d)
                for s in topo.stages_of(self.rank)
                for d in (-1, 1)
                if 0 <= s + d < topo.num_stages and not topo.is_local_edge(min(s, s + d))
            }
            - {me}
        )
        ops = []
        for p in peers:  # a few MiB so that NCCL connects every channel it uses for a peer
            ops.append(dist.P2POp(dist.isend, torch.zeros(1 << 20, device=self.device), p, self.group))
            ops.append(dist.P2POp(dist.irecv, torch.empty(1 << 20, device=self.device), p, self.group))
        if ops:
            for w in dist.batch_isend_irecv(ops):
                w.wait()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # --- communication ---
    def _post(self, ops: list[dist.P2POp], what: list[Action], *, wait: bool) -> list[Any]:
        """Post `ops` as one group; with `wait` (or in lockstep) block until it completed on the GPU."""
        if log.isEnabledFor(logging.DEBUG):
            sent = [(o.op.__name__, o.peer, tuple(o.tensor.shape), str(o.tensor.dtype)) for o in ops]
            log.debug("pp-rank %d posts %s: %s", self.rank, [str(x) for x in what], sent)
        works = dist.batch_isend_irecv(ops)
        if wait or self._lockstep:
            for w in works:
                w.wait()  # NCCL: the current stream waits for the group
                self._waited[id(w)] = w
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
            log.debug("pp-rank %d: group done", self.rank)
        else:
            self._pending.extend(works)
        return works

    def _issue(self, group: tuple[Action, ...]) -> None:
        """Post one communication group of the program.

        In a step that exchanges metadata, the first activation message of each stage edge is preceded by
        its metadata (keys, dtypes, shapes, requires_grad), posted as a group of its own by both ends; the
        receiver reads it before it allocates the data buffers. Later steps reuse it, and a send whose
        tensors no longer match raises.
        """
        meta_ops: list[dist.P2POp] = []
        incoming: list[tuple[int, torch.Tensor]] = []
        for a in group:
            if a.kind is ActionKind.SEND_F:
                out = self.runner.outputs[(a.stage, a.microbatch)]
                meta = [
                    (k, str(v.dtype), tuple(v.shape), bool(v.requires_grad)) for k, v in sorted(out.items())
                ]
                known = self._out_meta.get(a.stage)
                if known is None:
                    raw = json.dumps(meta).encode()
                    if len(raw) > _META_BYTES:
                        raise ValueError(
                            f"stage {a.stage} outputs too many tensors to describe in {_META_BYTES} bytes"
                        )
                    buf = torch.zeros(_META_BYTES, dtype=torch.uint8)
                    buf[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
                    meta_ops.append(
                        dist.P2POp(dist.isend, buf.to(self.device), self._peer(a.stage + 1), self.group)
                    )
                    self._out_meta[a.stage] = meta
                elif known != meta:
                    raise ValueError(
                        f"stage {a.stage}'s outputs for microbatch {a.microbatch} are {meta}, but the pipeline "
                        f"exchanged {known} (keys, dtypes, shapes, requires_grad) at its first step; when they "
                        "change, call step(..., new_shapes=True) on every pp-rank"
                    )
            elif a.kind is ActionKind.RECV_F and a.stage not in self._meta:
                buf = torch.zeros(_META_BYTES, dtype=torch.uint8, device=self.device)
                meta_ops.append(dist.P2POp(dist.irecv, buf, self._peer(a.stage - 1), self.group))
                incoming.append((a.stage, buf))
        if meta_ops:
            self._post(meta_ops, list(group), wait=True)
            for stage, buf in incoming:
                raw = bytes(buf.cpu().tolist()).rstrip(b"\0")
                self._meta[stage] = [(k, _DTYPES[d], tuple(sh), rg) for k, d, sh, rg in json.loads(raw)]
        works = self._post([op for a in group for op in self._data_ops(a)], list(group), wait=False)
        for a in group:
            if a.kind in (ActionKind.RECV_F, ActionKind.RECV_B):
                self._recv_works[a] = works

    def _ready(self, entry: AnyAction) -> bool:
        """Whether every send of a communication entry has its data already."""
        r = self.runner
        return all(
            (a.stage, a.microbatch) in (r.outputs if a.kind is ActionKind.SEND_F else r.input_grads)
            for a in entry.sub_actions()
            if a.kind in (ActionKind.SEND_F, ActionKind.SEND_B)
        )

    def _data_ops(self, a: Action) -> list[dist.P2POp]:
        r, s, k = self.runner, a.stage, a.microbatch
        if a.kind is ActionKind.SEND_F:
            out = r.outputs[(s, k)]
            return [dist.P2POp(dist.isend, v.detach().contiguous(), self._peer(s + 1), self.group)
                    for _, v in sorted(out.items())]  # fmt: skip
        if a.kind is ActionKind.SEND_B:
            grads = r.input_grads.pop((s, k))
            return [
                dist.P2POp(dist.isend, g.contiguous(), self._peer(s - 1), self.group)
                for _, g in sorted(grads.items())
            ]
        if a.kind is ActionKind.RECV_F:
            bufs = {
                key: torch.empty(shape, dtype=dt, device=self.device) for key, dt, shape, _ in self._meta[s]
            }
            self._recv_f[(s, k)] = (bufs, {key: rg for key, _, _, rg in self._meta[s]})
            return [dist.P2POp(dist.irecv, bufs[key], self._peer(s - 1), self.group) for key in sorted(bufs)]
        # RECV_B: gradients for this stage's outputs that require grad, in key order
        out = r.outputs[(s, k)]
        bufs = {key: torch.empty_like(v) for key, v in sorted(out.items()) if v.requires_grad}
        r.output_grads[(s, k)] = bufs
        return [dist.P2POp(dist.irecv, bufs[key], self._peer(s + 1), self.group) for key in sorted(bufs)]

    def _wait(self, a: Action) -> None:
        # gloo hangs when a finished receive is waited on twice: wait each work object once.
        for w in self._recv_works.pop(a, []):
            if id(w) not in self._waited:
                w.wait()
                self._waited[id(w)] = w

    # --- compute ---
    def _forward(self, a: Action, state: PipelineState) -> None:
        s, k, r = a.stage, a.microbatch, self.runner
        if s == 0:
            if self._mb_inputs is None:
                raise ValueError(f"pp-rank {self.rank} holds stage 0 and needs `inputs` in step()")
            inputs = {key: v.to(self.device) for key, v in self._mb_inputs[k].items()}
        elif self.topology.is_local_edge(s - 1):
            prev = r.outputs[(s - 1, k)]
            inputs = {key: _leaf(v, v.requires_grad and r.has_backward) for key, v in prev.items()}
        else:
            self._wait(Action(s, ActionKind.RECV_F, k))
            bufs, rg = self._recv_f.pop((s, k))
            inputs = {key: _leaf(v, rg[key] and r.has_backward) for key, v in bufs.items()}
        r.forward(s, k, inputs, state)
        if s > 0 and self.topology.is_local_edge(s - 1) and not r.has_backward:
            r.outputs.pop((s - 1, k), None)

    def _backward(self, a: Action) -> None:
        s, k, r = a.stage, a.microbatch, self.runner
        if s < self.topology.num_stages - 1 and a.kind is not ActionKind.BACKWARD_WEIGHT:
            if self.topology.is_local_edge(s):
                r.output_grads[(s, k)] = r.input_grads.pop((s + 1, k))
            else:
                self._wait(Action(s, ActionKind.RECV_B, k))
        mod = r.module(s)
        if _is_fsdp(mod) and not self._manual_fsdp:
            # Older torch: let FSDP reduce in the post-backward of the stage's last backward of the step.
            last = self._last_backward.get(s) == a
            mod.set_requires_gradient_sync(last)  # type: ignore[operator]
            mod.set_is_last_backward(last)  # type: ignore[operator]
        m = self.num_microbatches
        if a.kind is ActionKind.BACKWARD:
            r.backward(s, k, m)
        elif a.kind is ActionKind.BACKWARD_INPUT:
            r.backward_input(s, k, m)
        else:
            r.backward_weight(s, k)

    def _compute(self, act: AnyAction, state: PipelineState, idx: int) -> None:
        log.debug("pp-rank %d computes %s", self.rank, act)
        if isinstance(act, OverlapAction):
            # Forward first while the backward's gradient receive is still in flight; then post the next
            # communication group (the forward's activation send) so it travels while the backward computes.
            self._forward(act.forward, state)
            acts = self.program.actions[self.rank]
            nxt = acts[idx + 1] if idx + 1 < len(acts) else None
            if nxt is not None and nxt.is_comm and not self._lockstep and self._ready(nxt):
                self._issue(nxt.sub_actions())
                self._posted_early.add(idx + 1)
            self._backward(act.backward)
            return
        assert isinstance(act, Action)
        if act.kind is ActionKind.FORWARD:
            self._forward(act, state)
        else:
            self._backward(act)

    def step(
        self,
        inputs: Mapping[str, torch.Tensor] | None,
        state: PipelineState,
        *,
        new_shapes: bool = False,
    ) -> StepResult:
        """Run forward (and backward) of every microbatch of the step.

        Args:
            inputs: keyword tensors of the first stage for the whole step (split along dim 0); only read on
                the rank holding stage 0.
            state: the step's :class:`PipelineState` (same num_microbatches); receives ``loss`` per microbatch
                (and the last stage's outputs for forward-only programs).
            new_shapes: exchange the stages' output metadata (keys, dtypes, shapes) again; pass the same
                value on every pp-rank. The first step always does; later steps reuse it.

        A step that exchanges metadata also runs in lockstep: each communication group is waited for on the
        host before going on, so that no transfer is in flight while this rank computes. The first launch
        of a kernel (a new Triton specialisation, a lazily loaded or JIT-compiled CUDA kernel), which new
        shapes bring, waits for the GPU's in-flight NCCL operations; with the peer blocked the same way the
        pipeline would deadlock (measured on 2 H200s, see benchmarks/multigpu/module_load_probe.py).
        Lockstep cannot deadlock a validated program (the validator's dry run checks both modes).
        """
        self._lockstep = self._steps == 0 or new_shapes
        if self._lockstep:
            self._meta: dict[int, list[tuple[str, torch.dtype, tuple[int, ...], bool]]] = {}
            self._out_meta: dict[int, list[tuple[str, str, tuple[int, ...], bool]]] = {}
        self._steps += 1
        m = self.num_microbatches
        if state.num_microbatches != m:
            raise ValueError(f"state has {state.num_microbatches} microbatches but the schedule has {m}")
        self._mb_inputs = (
            _split_inputs(inputs, m) if inputs is not None and 0 in self.runner.modules else None
        )
        self.runner.reset()
        self._recv_f: dict[tuple[int, int], tuple[dict[str, torch.Tensor], dict[str, bool]]] = {}
        self._recv_works: dict[Action, list[Any]] = {}
        self._pending: list[Any] = []
        self._waited: dict[int, Any] = {}  # id -> work, kept alive so that its id is not reused
        self._posted_early: set[int] = set()
        self._start_fsdp()
        for i, act in enumerate(self.program.actions[self.rank]):
            if not act.is_comm:
                self._compute(act, state, i)
            elif i not in self._posted_early:
                self._issue(act.sub_actions())
        for w in self._pending:
            if id(w) not in self._waited:
                w.wait()
        self._pending.clear()
        self._waited.clear()
        self._finish_fsdp()
        self.runner.reset()
        return StepResult(self.runner.step_loss(state, m))

    def _start_fsdp(self) -> None:
        """FSDP2 stage modules: accumulate unsharded gradients over the step, reduce once at its end.

        With torch's manual backward finalization (newer torch) the reduction runs after the step's last
        backward, which split backward needs: FSDP's own post-backward hook fires during the ``I`` pass,
        before ``W`` has produced any weight gradient.
        """
        fsdp = [m for m in self.runner.modules.values() if _is_fsdp(m)]
        self._manual_fsdp = bool(fsdp) and all(hasattr(m, "finalize_backward") for m in fsdp)
        if fsdp and self.splits_backward and not self._manual_fsdp:
            raise RuntimeError(
                f"schedule {self.program.name!r} splits the backward (I/W), which with FSDP2 stage modules needs "
                "torch's FSDPModule.finalize_backward (not in this torch version); use a full-backward schedule "
                "(gpipe, 1f1b, looped_bfs, interleaved_1f1b) or a newer torch"
            )
        if self._manual_fsdp and self.program.has_backward:
            for m in fsdp:
                m.set_manual_backward_finalization(True)  # type: ignore[operator]
                m.set_requires_gradient_sync(False)  # type: ignore[operator]
                m.set_reshard_after_backward(False)  # type: ignore[operator]

    def _finish_fsdp(self) -> None:
        for mod in self.runner.modules.values():
            if not _is_fsdp(mod):
                continue
            mod.set_requires_gradient_sync(True)  # type: ignore[operator]
            if self._manual_fsdp and self.program.has_backward:
                mod.set_reshard_after_backward(True)  # type: ignore[operator]
                mod.finalize_backward()  # type: ignore[operator]
                mod.set_manual_backward_finalization(False)  # type: ignore[operator]
            else:
                mod.set_is_last_backward(True)  # type: ignore[operator]


class OfflineExecutor:
    """pp=1 executor with the same :meth:`step` as :class:`PipelineExecutor`: stages chained on one process.

    Args:
        stage_modules: every stage, keyed 0..n-1, run in order.
        loss_fn: ``(last_stage_outputs, microbatch_view) -> scalar``; None runs forward only.
        num_microbatches: microbatches per step (gradient accumulation).
        forward_kwargs_fn: optional extra keyword tensors per (stage, microbatch).
        loss_reduction: ``"mean"`` or ``"sum"`` as for :class:`PipelineExecutor`.
    """

    def __init__(
        self,
        stage_modules: Mapping[int, nn.Module],
        loss_fn: LossFn | None,
        num_microbatches: int,
        *,
        forward_kwargs_fn: ForwardKwargsFn | None = None,
        loss_reduction: Literal["mean", "sum"] = "mean",
    ) -> None:
        if sorted(stage_modules) != list(range(len(stage_modules))) or not stage_modules:
            raise ValueError(f"OfflineExecutor needs stages 0..n-1, got {sorted(stage_modules)}")
        if num_microbatches < 1:
            raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
        self.num_microbatches = num_microbatches
        self.runner = _StageRunner(
            stage_modules, len(stage_modules), loss_fn, forward_kwargs_fn, loss_reduction, loss_fn is not None
        )

    def step(self, inputs: Mapping[str, torch.Tensor] | None, state: PipelineState) -> StepResult:
        """Forward (and backward) every microbatch through all stages; gradients accumulate."""
        m, r = self.num_microbatches, self.runner
        if state.num_microbatches != m:
            raise ValueError(f"state has {state.num_microbatches} microbatches but the executor has {m}")
        if inputs is None:
            raise ValueError("OfflineExecutor.step needs the first stage's inputs")
        mbs = _split_inputs(inputs, m)
        r.reset()
        n = r.num_stages
        for k in range(m):
            x: dict[str, torch.Tensor] = mbs[k]
            for s in range(n):
                r.forward(s, k, x, state)
                if s < n - 1:
                    x = {
                        key: _leaf(v, v.requires_grad and r.has_backward)
                        for key, v in r.outputs[(s, k)].items()
                    }
            if r.has_backward:
                for s in reversed(range(n)):
                    if s < n - 1:
                        r.output_grads[(s, k)] = r.input_grads.pop((s + 1, k))
                    r.backward(s, k, m)
                r.input_grads.clear()
            r.reset()
        return StepResult(r.step_loss(state, m))
