"""The :class:`Trainer`: one object that wires providers, data, optimizers and trackers into a step loop.

It owns no model knowledge: the model comes from a :class:`~plait.loop.providers.ModelProvider`,
the loss from a :class:`~plait.loop.providers.Task`. Each phase publishes typed events
(:mod:`plait.loop.events`); checkpointing and model-specific updates (e.g. MoE router biases)
subscribe to them. :meth:`Trainer.app_state` exposes every piece of training state as a
``Stateful`` for torch.distributed.checkpoint.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from plait.dist_core import set_gradient_sync
from plait.loop.checkpoint import (
    Checkpointer,
    ModelState,
    OptimizerState,
    PerRankState,
    PreemptionHandler,
    RngState,
)
from plait.loop.config import TrainerConfig
from plait.loop.events import (
    AfterBackward,
    AfterForwardBackward,
    AfterOptimizerStep,
    BeforeForwardBackward,
    BeforeOptimizerStep,
    Event,
    EventBus,
    MetricsLogged,
    StepEnd,
    StepSkipped,
    StepStart,
    TrainingEnd,
    TrainingStart,
)
from plait.loop.grads import all_reduce_plain_grads, clip_grad_norm, prepare_fsdp_for_sum
from plait.loop.metrics import Max, Mean, MetricCollection
from plait.loop.ops import GCController, StepProfiler, mesh_prefix, set_collective_timeout, setup_logging
from plait.loop.optim import PiecewiseLR, build_optimizer
from plait.loop.providers import DataProvider, LRSchedulerProvider, ModelProvider, OptimizerProvider, Task
from plait.loop.topology import Topology
from plait.loop.tracking import (
    RunSummaryCollector,
    ThroughputMeter,
    Tracker,
    build_tracker,
    device_memory_stats,
    peak_flops_for,
)
from torch import nn
from torch.distributed.checkpoint import LoadPlanner, SavePlanner, StorageWriter

__all__ = ["StepResult", "Trainer", "TrainerState"]

logger = logging.getLogger("plait.loop")
Batch = dict[str, torch.Tensor]

# Model inputs given to every pipeline stage (not only the first) when pp > 1.
_STAGE_KWARGS = ("position_ids", "document_ids", "attention_mask")


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
        self.tracker_run_ids = dict(state.get("tracker_run_ids", {}))


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


class Trainer:
    """Trains a model given by providers under a :class:`~plait.loop.TrainerConfig`.

    Construction builds everything (mesh context, model stages on meta -> parallelize -> materialise
    -> initial weights, optimizers, LR scheduler, data loader), so a checkpoint can be loaded into
    :meth:`app_state` before :meth:`fit`.

    Args:
        config: the configuration.
        model: builds and prepares the model's stages.
        data: builds this rank's :class:`~plait.loop.data.DistributedDataLoader`.
        task: batch -> model inputs; model outputs -> loss.
        ctx: a ``plait.dist_core.DistributedContext`` (anything with ``mesh_for("batch")``); None
            builds one with ``DistributedContext.from_env(config.mesh)`` (torchrun's environment, or
            a single process). It is passed to ``model.parallelize``.
        optimizer: per-model-part optimizer factory (default: from ``config.optimizer``).
        lr_scheduler: scheduler factory (default: :class:`~plait.loop.optim.PiecewiseLR` from
            ``config.lr_schedule``).
        trackers: replace the trackers of ``config.logging.trackers`` (main rank only).
        device: overrides ``config.run.device``.
        save_planner, storage_writer_factory, load_planner: DCP hooks passed to the
            :class:`~plait.loop.checkpoint.Checkpointer` (see there).
    """

    def __init__(
        self,
        config: TrainerConfig,
        model: ModelProvider,
        data: DataProvider,
        task: Task,
        *,
        ctx: Any = None,
        optimizer: OptimizerProvider | None = None,
        lr_scheduler: LRSchedulerProvider | None = None,
        trackers: Sequence[Tracker] | None = None,
        device: torch.device | str | None = None,
        save_planner: SavePlanner | None = None,
        storage_writer_factory: Callable[[Path], StorageWriter] | None = None,
        load_planner: LoadPlanner | None = None,
    ) -> None:
        self.config = config
        self._checkpoint_hooks: dict[str, Any] = {
            "save_planner": save_planner,
            "storage_writer_factory": storage_writer_factory,
            "load_planner": load_planner,
        }
        self.model_provider = model
        self.task = task
        self.events = EventBus()
        self.state = TrainerState()
        self.run_dir = Path(config.run.run_dir)
        self._stop_requested = False
        self._given_trackers = list(trackers) if trackers is not None else None
        self.trackers: list[Tracker] = []

        self.device = self._pick_device(device)
        self.ctx, self.topology = self._build_topology(ctx)
        topo = self.topology
        self.log = setup_logging(mesh_prefix(topo.rank, topo.coords, topo.sizes), config.logging.level)
        if topo.dp_size != config.dp_size:
            raise ValueError(
                f"mesh: the batch domain's dp size is {topo.dp_size} but the config's mesh section gives "
                f"data_replicate x data_shard = {config.dp_size}"
            )
        self.grad_accum_steps = config.batching.grad_accum_steps(topo.dp_size)
        if config.determinism.deterministic_algorithms:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)

        # Model: build on meta, parallelize, materialise, load weights.
        torch.manual_seed(config.run.seed)
        self.pipeline_config: Any = None
        self.stage_indices, num_stages = self._stage_layout()
        self.model_parts: list[nn.Module] = []
        for s in self.stage_indices:
            part = model.build_stage(s, num_stages)
            part = model.parallelize(part, self.ctx, config)
            model.materialize(part, self.device)
            self.model_parts.append(part)
        model.load_initial_weights(self.model_parts)
        for part in self.model_parts:
            part.train()
        self._sync_modules = prepare_fsdp_for_sum(self.model_parts)
        if topo.cp_size > 1 and self._has_plain_params():
            raise NotImplementedError(
                "context parallelism needs the model's parameters managed by FSDP2/DTensor"
            )

        # Optimizers (one per model part, so state dicts stay keyed by FQN) and LR schedule.
        opt_factory = optimizer or (lambda module, cfg: build_optimizer(cfg.optimizer, module))
        self.optimizers = [opt_factory(part, config) for part in self.model_parts]
        if lr_scheduler is not None:
            self.lr_scheduler = lr_scheduler(self.optimizers, config)
        else:
            self.lr_scheduler = PiecewiseLR(self.optimizers, config.lr_schedule, config.run.steps)

        self.data_loader = data.build_loader(config, topo.dp_rank, topo.dp_size)
        if self.data_loader.grad_accum_steps != self.grad_accum_steps:
            raise ValueError(
                f"data loader gives {self.data_loader.grad_accum_steps} microbatches per step, "
                f"config derives {self.grad_accum_steps}"
            )
        self.executor = self._build_executor(num_stages) if topo.pp_size > 1 else None

        # Metrics are reduced over the whole world: replicas (tp, cp) scale numerator and weight alike.
        self.metrics = MetricCollection(group=None)
        self.metrics.add("loss", Mean())
        self.metrics.add("grad_norm", Mean())
        self.metrics.add("grad_norm_max", Max())
        flops = model.flops_per_token(config.batching.seq_len) if hasattr(model, "flops_per_token") else None
        peak = config.logging.peak_flops or peak_flops_for(self.device)
        self.throughput = ThroughputMeter(flops, peak, topo.world_size)
        self.gc = GCController(config.gc)
        self.profiler = StepProfiler(config.profiling, self.run_dir / "profile", topo.rank)
        self.rng = RngState()
        self.checkpointer: Checkpointer | None = None
        if config.checkpoint.enabled:
            self._setup_checkpointing()
        self._bar: Any = None
        self._last_lr = math.nan
        self.stop_signal: int | None = None  # the signal that stopped fit() early, if one did
        self.run_summary = RunSummaryCollector(self)  # printed and written by close()

    # ------------------------------------------------------------------ setup helpers
    def _pick_device(self, device: torch.device | str | None) -> torch.device:
        kind = str(device) if device is not None else self.config.device_type()
        dev = torch.device(kind)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(dev)
        return dev

    def _build_topology(self, ctx: Any) -> tuple[Any, Topology]:
        if ctx is None:
            from plait.dist_core import DistributedContext

            # Start-up collectives (weight loading, compilation) run under the long init timeout.
            # In a single process this creates no process group (providers may still ask for meshes).
            ctx = DistributedContext.from_env(
                self.config.mesh, device=self.device, timeout=self.config.timeouts.init_s
            )
        if getattr(ctx, "world_size", None) == 1 and not dist.is_initialized():
            return ctx, Topology()
        return ctx, Topology.from_context(ctx)

    def _stage_layout(self) -> tuple[list[int], int]:
        pp = self.topology.pp_size
        if pp == 1:
            return [0], 1
        from plait.pipelining import OneFOneBConfig

        pc = self.config.pipeline or OneFOneBConfig(num_microbatches=self.grad_accum_steps)
        # The loop divides each microbatch's summed loss by the global token count itself.
        self.pipeline_config = pc.model_copy(update={"loss_reduction": "sum"})
        topo = self.pipeline_config.topology(pp)
        return sorted(topo.stages_of(self.topology.pp_rank)), int(topo.num_stages)

    def _build_executor(self, num_stages: int) -> Any:
        from plait.pipelining import build_pipeline

        stage_modules = dict(zip(self.stage_indices, self.model_parts))
        has_last = (num_stages - 1) in stage_modules
        task = self.task

        def loss_fn(outputs: Mapping[str, torch.Tensor], mb: Any) -> torch.Tensor:
            # Runs in this process on the rank holding the last stage.
            batch = {k: mb[k] for k in self._batch_keys}
            lo = task.loss(outputs, batch)
            self._pp_loss[0] += float(lo.loss_sum)
            self._pp_loss[1] += float(lo.num_tokens)
            for name, (value, weight) in lo.metrics.items():
                self.metrics.update(name, value, weight)
            return lo.objective / self._global_tokens

        def forward_kwargs_fn(stage_index: int, mb: Any) -> dict[str, torch.Tensor]:
            return {k: mb[k] for k in self._stage_kwargs_keys}

        self._has_last_stage = has_last
        executor = build_pipeline(
            self.pipeline_config,
            pp_group=self.topology.pp_group,
            stage_modules=stage_modules,
            loss_fn=loss_fn,
            forward_kwargs_fn=forward_kwargs_fn,
        )
        import torch._functorch.config as functorch_config

        if getattr(executor, "splits_backward", False) and functorch_config.donated_buffer:
            # The I pass keeps the autograd graph for the W pass (retain_graph); a torch.compile'd backward
            # with donated buffers refuses that (seen with the compiled FlexAttention on GPU). The compiled
            # parts (FlexAttention, per-layer compile) compile at their first forward, after this.
            functorch_config.donated_buffer = False
            logger.info("split-backward schedule: torch._functorch.config.donated_buffer set to False")
        return executor

    def _set_timeout(self, seconds: float) -> None:
        if self.ctx is not None and hasattr(self.ctx, "set_timeout"):
            self.ctx.set_timeout(seconds)
        else:
            set_collective_timeout(seconds, self.topology.groups)

    def _has_plain_params(self) -> bool:
        from torch.distributed.tensor import DTensor

        return any(not isinstance(p, DTensor) for part in self.model_parts for p in part.parameters())

    # ------------------------------------------------------------------ public API
    @property
    def step(self) -> int:
        """Completed optimizer steps (including skipped ones)."""
        return self.state.step

    def parameters(self) -> list[nn.Parameter]:
        """Trainable parameters of all local model parts."""
        return [p for part in self.model_parts for p in part.parameters() if p.requires_grad]

    def subscribe(self, event_type: type[Event], fn: Callable[[Any], None]) -> Callable[[], None]:
        """Shortcut for ``trainer.events.subscribe``; returns the unsubscribe function."""
        return self.events.subscribe(event_type, fn)

    def request_stop(self) -> None:
        """Finish the current step, then leave :meth:`fit` (e.g. from a SIGTERM handler)."""
        self._stop_requested = True

    def app_state(self) -> dict[str, Any]:
        """Every part of the training state as ``Stateful`` objects, for torch.distributed.checkpoint.

        Keys: ``model`` and ``optimizer`` (FQN-keyed, DTensors stay sharded: reshardable),
        ``lr_scheduler``, ``data`` (global, dp-size independent), ``metrics`` (running accumulators),
        ``trainer`` (step, skipped steps, tokens seen, tracker run ids) — identical on all ranks or
        sharded DTensors — and ``rng`` (every rank's generators, keyed ``rank<N>``).
        """
        return {
            "model": ModelState(self.model_parts),
            "optimizer": OptimizerState(self.model_parts, self.optimizers),
            "lr_scheduler": self.lr_scheduler,
            "data": self.data_loader,
            "metrics": PerRankState(self.metrics),
            "trainer": self.state,
            "rng": self.rng,
        }

    # ------------------------------------------------------------------ the step
    def _to_device(self, batch: Batch) -> Batch:
        return {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}

    def _all_reduce(self, values: list[float], group: Any = None, world: bool = False) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64)
        if dist.is_initialized() and (world or group is not None):
            if dist.get_backend(group) == "nccl":
                t = t.to(self.device)
            dist.all_reduce(t, group=None if world else group)
        return [float(x) for x in t.tolist()]

    def forward_backward(self, microbatches: Sequence[Batch]) -> tuple[float, float, int]:
        """Forward and backward of this rank's microbatches, gradients synchronised over dp.

        The objective of each microbatch is divided by the step's global loss-token count, so the
        accumulated gradient is the token-weighted mean over all microbatches of all dp ranks.

        Returns:
            ``(local_loss_sum, local_loss_tokens, global_tokens)``.
        """
        mbs = [self._to_device(mb) for mb in microbatches]
        local_tokens = sum(self.task.num_loss_tokens(mb) for mb in mbs)
        local_inputs = sum(int(mb["input_ids"].numel()) if "input_ids" in mb else 0 for mb in mbs)
        global_tokens, global_inputs = (
            int(v) for v in self._all_reduce([local_tokens, local_inputs], self.topology.dp_group)
        )
        if global_tokens == 0:
            raise ValueError(
                f"step {self.step}: the global batch has no loss tokens (all labels are ignored)"
            )
        self._global_tokens = global_tokens
        self._global_inputs = global_inputs or global_tokens
        self.events.publish(BeforeForwardBackward(self, self.step, len(mbs), global_tokens))
        loss_sum, loss_tokens = 0.0, 0.0
        if self.executor is None:
            for i, mb in enumerate(mbs):
                last = i == len(mbs) - 1
                # Reduce-scatter / all-reduce only after the last microbatch's backward.
                for m in self._sync_modules:
                    set_gradient_sync(m, last)
                outputs = self.model_parts[0](**self.task.model_inputs(mb))
                lo = self.task.loss(outputs, mb)
                (lo.objective / global_tokens).backward()
                loss_sum += float(lo.loss_sum)
                loss_tokens += lo.num_tokens
                for name, (value, weight) in lo.metrics.items():
                    self.metrics.update(name, value, weight)
                self.events.publish(AfterBackward(self, self.step, i))
        else:
            loss_sum, loss_tokens = self._pipeline_step(mbs)
        if self.topology.dp_size > 1:
            all_reduce_plain_grads(self.parameters(), self.topology.dp_group, self.config.gradients)
        self.events.publish(AfterForwardBackward(self, self.step))
        return loss_sum, loss_tokens, global_tokens

    def _pipeline_step(self, mbs: Sequence[Batch]) -> tuple[float, float]:
        from plait.pipelining import PipelineState, Split, Stack

        batch = _concat_padded(mbs)
        inputs = self.task.model_inputs(batch)
        self._stage_kwargs_keys = [k for k in inputs if k in _STAGE_KWARGS]
        self._batch_keys = list(batch)
        first = {k: v for k, v in inputs.items() if k not in self._stage_kwargs_keys}
        specs: dict[str, Any] = {k: Split(0) for k in batch}
        specs["loss"] = Stack()
        state = PipelineState(len(mbs), specs=specs)
        state.reset()
        for k, v in batch.items():
            state.global_view[k] = v
        self._pp_loss = [0.0, 0.0]
        assert self.executor is not None
        self.executor.step(first, state)
        return self._pp_loss[0], self._pp_loss[1]

    def train_step(self, microbatches: Sequence[Batch]) -> StepResult:
        """One optimizer step on this rank's microbatches (see the module docs for the phases)."""
        cfg = self.config
        step = self.step
        loss_sum, loss_tokens, global_tokens = self.forward_backward(microbatches)
        g_sum, g_tokens = self._all_reduce([loss_sum, loss_tokens], world=True)
        loss = g_sum / g_tokens if g_tokens else math.nan
        grad_norm = float(
            clip_grad_norm(
                self.parameters(), cfg.grad_clip.max_norm, cfg.grad_clip.norm_type, self.topology.pp_group
            )
        )
        lr = self.lr_scheduler.get_last_lr()[0] if hasattr(self.lr_scheduler, "get_last_lr") else math.nan
        skipped = not (math.isfinite(loss) and math.isfinite(grad_norm))
        if skipped:
            what = f"loss={loss}, grad_norm={grad_norm}"
            if cfg.determinism.nonfinite_loss == "raise":
                raise FloatingPointError(f"non-finite {what} at step {step} on rank {self.topology.rank}")
            self.state.skipped_steps += 1
            for opt in self.optimizers:
                opt.zero_grad(set_to_none=True)
            self.events.publish(StepSkipped(self, step, loss, self.state.skipped_steps))
            limit = cfg.determinism.max_skipped_steps
            if limit is not None and self.state.skipped_steps > limit:
                raise FloatingPointError(
                    f"{self.state.skipped_steps} steps skipped for non-finite values (last: {what} at step "
                    f"{step} on rank {self.topology.rank}), more than determinism.max_skipped_steps={limit}"
                )
        else:
            self.events.publish(BeforeOptimizerStep(self, step, grad_norm))
            if self.checkpointer is not None:  # a pending save may still be copying these tensors
                self.checkpointer.wait_for_staging()
            for opt in self.optimizers:
                opt.step()
        # The schedule follows the step count, skipped steps included.
        self.lr_scheduler.step()
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        if not skipped:
            self.events.publish(AfterOptimizerStep(self, step))
            self.metrics.update("loss", loss_sum / loss_tokens if loss_tokens else 0.0, loss_tokens)
            self.metrics.update("grad_norm", grad_norm)
            self.metrics["grad_norm_max"].update(grad_norm)  # type: ignore[union-attr]
        self._last_lr = lr
        self.state.step += 1
        self.state.tokens_seen += self._global_inputs
        self.throughput.add(self._global_inputs)
        return StepResult(loss, grad_norm, lr, global_tokens, skipped)

    # ------------------------------------------------------------------ the run
    def _open_trackers(self) -> None:
        if not self.topology.is_main:
            return
        if self._given_trackers is not None:
            self.trackers = list(self._given_trackers)
        else:
            for tc in self.config.logging.trackers:
                tracker = build_tracker(
                    tc.kind,
                    self.run_dir,
                    project=tc.project or self.config.run.name,
                    run_id=self.state.tracker_run_ids.get(tc.kind),
                    total_steps=self.config.run.steps,
                    write=self._write,
                    start_step=self.step,
                    **tc.options,
                )
                if tracker.run_id is not None:
                    self.state.tracker_run_ids[tc.kind] = tracker.run_id
                self.trackers.append(tracker)
        for t in self.trackers:
            t.log_config(self.config.model_dump(mode="json"))

    def _write(self, line: str) -> None:
        if self._bar is not None:
            self._bar.write(line)
        else:
            logger.info(line)

    def _log(self) -> None:
        values = self.metrics.compute(sync=True)
        values["lr"] = self._last_lr
        values.update(self.throughput.measure())
        values.update(device_memory_stats(self.device))
        values["skipped_steps"] = float(self.state.skipped_steps)
        values["tokens_seen"] = float(self.state.tokens_seen)
        self.metrics.reset()
        if self.topology.is_main:
            for t in self.trackers:
                t.log(values, self.step)
        self.events.publish(MetricsLogged(self, self.step, values))

    def fit(self, steps: int | None = None) -> dict[str, float]:
        """Train until ``steps`` (default ``config.run.steps``) optimizer steps are done, or a stop request.

        Returns:
            The last logged metrics.
        """
        total = steps if steps is not None else self.config.run.steps
        last_logged: dict[str, float] = {}
        unsub = self.events.subscribe(MetricsLogged, lambda e: last_logged.update(e.metrics))
        self._open_trackers()
        if self.topology.is_main and self.config.logging.progress_bar:
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=self.step, dynamic_ncols=True, desc=self.config.run.name)
        self.gc.start()
        self.profiler.start()
        self._set_timeout(self.config.timeouts.init_s)
        self.events.publish(TrainingStart(self, self.step))
        ck = self.config.checkpoint
        preemption = (
            PreemptionHandler(ck.grace_period_s, self._host_group())
            if self.checkpointer is not None and ck.save_on_signal
            else None
        )
        first = True
        try:
            while self.step < total and not self._stop_requested:
                self.events.publish(StepStart(self, self.step))
                t0 = time.perf_counter()
                microbatches = next(self.data_loader)
                result = self.train_step(microbatches)
                self.gc.step(self.step)
                self.profiler.step()
                if first:
                    self._set_timeout(self.config.timeouts.step_s)
                    first = False
                if self.step % self.config.logging.interval == 0 or self.step == total:
                    self._log()
                if self._bar is not None:
                    self._bar.update(1)
                    self._bar.set_postfix(
                        loss=f"{result.loss:.4f}", s_per_step=f"{time.perf_counter() - t0:.2f}"
                    )
                self.events.publish(
                    StepEnd(self, self.step, {"loss": result.loss, "grad_norm": result.grad_norm})
                )
                if preemption is not None and preemption.should_stop():
                    self._stop_requested = True
                if self.checkpointer is not None:
                    last = self.step == total or self._stop_requested
                    if last or (ck.interval is not None and self.step % ck.interval == 0):
                        self.save_checkpoint(blocking=last)
            self.events.publish(TrainingEnd(self, self.step, stopped_early=self.step < total))
        finally:
            if preemption is not None:
                self.stop_signal = preemption.received
                preemption.restore()
            self.profiler.stop()
            self.gc.stop()
            unsub()
            if self._bar is not None:
                self._bar.close()
                self._bar = None
        return last_logged

    # ------------------------------------------------------------------ checkpoints
    def _host_group(self) -> Any:
        return getattr(self.ctx, "host_group", None) if dist.is_initialized() else None

    def _setup_checkpointing(self) -> None:
        ck = self.config.checkpoint
        root = Path(ck.dir) if ck.dir else self.run_dir / "checkpoints"
        self.checkpointer = ckpt = Checkpointer(
            root,
            keep_last=ck.keep_last,
            async_mode=ck.async_mode,
            process_group=self._host_group(),
            checksums=ck.checksums,
            on_damaged=ck.on_damaged,
            coordinator_rank=ck.coordinator_rank,
            **self._checkpoint_hooks,
        )
        # Finalise each save as soon as it is written; prepare the staging buffers after the first step.
        self.events.subscribe(StepEnd, lambda e: ckpt.step_done(self.app_state))
        if ck.resume and (resumed := ckpt.resume(self.app_state())) is not None:
            latest, meta = resumed
            self.log.info(
                "resumed from %s (step %d, saved by %s ranks)", latest, self.step, meta.get("world_size")
            )

    def save_checkpoint(self, *, blocking: bool = False) -> None:
        """Save the whole training state as checkpoint ``self.step`` (async unless ``blocking``)."""
        if self.checkpointer is None:
            raise RuntimeError("checkpoint.enabled is false: no checkpointer")
        self.checkpointer.save(
            self.step, self.app_state(), blocking=blocking, meta={"run": self.config.run.name}
        )

    def close(self) -> None:
        """Finish pending checkpoint writes, close the trackers, print and write the run summary
        (``summary.json``, ``loss_curve.png``; call once after the last :meth:`fit`)."""
        if self.checkpointer is not None:
            self.checkpointer.close()
        for t in self.trackers:
            t.close()
        self.trackers = []
        self.run_summary.write(self.run_dir)


def _concat_padded(mbs: Sequence[Batch]) -> Batch:
    """Concatenate microbatches along dim 0, right-padding the time dimension to a common length."""
    keys = list(mbs[0])
    length = max(int(mb[k].shape[1]) for mb in mbs for k in keys if mb[k].ndim >= 2)
    pads = {"labels": -100, "document_ids": -1}
    out: Batch = {}
    for k in keys:
        parts = []
        for mb in mbs:
            t = mb[k]
            if t.ndim >= 2 and t.shape[1] < length:
                t = torch.nn.functional.pad(t, (0, length - t.shape[1]), value=pads.get(k, 0))
            parts.append(t)
        out[k] = torch.cat(parts)
    return out
