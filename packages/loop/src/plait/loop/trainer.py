"""The :class:`Trainer`: one object that wires providers, data, optimizers and trackers into a step loop.

It owns no model knowledge: the model comes from a :class:`~plait.loop.providers.ModelProvider`,
the model inputs and the loss from a :class:`~plait.loop.providers.Task`. Every step, pipelined or not,
runs through one executor of plait.pipelining (pp=1: :class:`~plait.pipelining.OfflineExecutor`) on
the rank's step batch, split into the :class:`~plait.loop.BatchPlan`'s microbatches. Each phase
publishes typed events (:mod:`plait.loop.events`); checkpointing and model-specific updates (e.g. MoE
router biases) subscribe to them. :meth:`Trainer.app_state` exposes every piece of training state as a
``Stateful`` for torch.distributed.checkpoint.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from plait.dist_core import DistributedContext, clip_factor, prefetch_all_gathers
from plait.loop.batch_plan import BatchPlan
from plait.loop.checkpoint import (
    Checkpointer,
    ModelState,
    OptimizerState,
    PerRankState,
    PreemptionHandler,
    RngState,
    TrainingCheckpoints,
)
from plait.loop.config import TrainerConfig
from plait.loop.engine import Executor, build_executor, build_stages, place_stages
from plait.loop.evaluation import Evaluator
from plait.loop.events import (
    AfterBackward,
    AfterForwardBackward,
    AfterOptimizerStep,
    BeforeForwardBackward,
    BeforeOptimizerStep,
    E,
    EventBus,
    MetricsLogged,
    StepEnd,
    StepSkipped,
    StepStart,
    TrainingEnd,
    TrainingStart,
)
from plait.loop.grads import all_reduce_plain_grads, clip_grad_norm
from plait.loop.loss import LOSS_KEY, LossStats, PendingStep, StepLoss, StepMetrics
from plait.loop.metrics import Max, Mean, MetricCollection
from plait.loop.ops import (
    GCController,
    StepProfiler,
    apply_determinism,
    mesh_prefix,
    set_collective_timeout,
    setup_logging,
)
from plait.loop.optim import PiecewiseLR, build_optimizer
from plait.loop.providers import (
    DataProvider,
    LRScheduler,
    LRSchedulerProvider,
    ModelProvider,
    OptimizerProvider,
    Task,
)
from plait.loop.records import StepResult, TrainerState
from plait.loop.resilience import Heartbeat, StepWatchdog, StragglerMeter
from plait.loop.run_lock import lock_run_dir
from plait.loop.topology import connect, pick_device
from plait.loop.tracking import (
    RunReporter,
    RunSummaryCollector,
    RunTotals,
    ThroughputMeter,
    Tracker,
    device_memory_stats,
    peak_flops_for,
)
from plait.pipelining import PipelineState, Stack
from torch import nn
from torch.distributed.checkpoint import LoadPlanner, SavePlanner, StorageWriter
from torch.distributed.fsdp import FSDPModule

__all__ = ["StepResult", "Trainer", "TrainerState"]

Batch = dict[str, torch.Tensor]


class Trainer:
    """Trains a model given by providers under a :class:`~plait.loop.TrainerConfig`.

    Building a training job is separate from running it. Construction builds everything (mesh
    context, model stages on meta -> parallelize -> materialise -> initial weights, optimizers, LR
    scheduler, data loader, checkpointer) and loads no checkpoint; :meth:`fit` first calls
    :meth:`resume`, which loads the run directory's newest checkpoint (with ``checkpoint.enabled`` and
    ``checkpoint.resume``). Call :meth:`resume` yourself to see the resumed state (``step``, weights)
    before :meth:`fit`; to load a state of your own into :meth:`app_state`, call :meth:`resume` first
    (or leave checkpointing off), so that :meth:`fit` does not load a checkpoint over it.

    Construction also sets process-global torch state, before the initial weights are drawn
    (:func:`~plait.loop.ops.apply_determinism`): deterministic algorithms with
    ``determinism.deterministic_algorithms``, and the default generators' seed ``run.seed``.

    Args:
        config: the configuration.
        model: builds and prepares the model's stages.
        data: builds this rank's :class:`~plait.loop.data.DistributedDataLoader`.
        task: batch -> each stage's inputs; model outputs -> loss.
        ctx: the distributed context; None builds one with ``DistributedContext.from_env(config.mesh)`` (torchrun's environment, or
            a single process). It is passed to ``model.parallelize``.
        optimizer: per-model-part optimizer factory (default: from ``config.optimizer``).
        lr_scheduler: scheduler factory (default: :class:`~plait.loop.optim.PiecewiseLR` from
            ``config.lr_schedule``).
        trackers: replace the trackers of ``config.logging.trackers`` (main rank only).
        device: overrides ``config.run.device``.
        save_planner: a DCP hook passed to the :class:`~plait.loop.checkpoint.Checkpointer` (see there).
        storage_writer_factory: a DCP hook passed to the :class:`~plait.loop.checkpoint.Checkpointer`.
        load_planner: a DCP hook passed to the :class:`~plait.loop.checkpoint.Checkpointer`.
    """

    def __init__(
        self,
        config: TrainerConfig,
        model: ModelProvider,
        data: DataProvider,
        task: Task,
        *,
        ctx: DistributedContext | None = None,
        optimizer: OptimizerProvider | None = None,
        lr_scheduler: LRSchedulerProvider | None = None,
        trackers: Sequence[Tracker] | None = None,
        device: torch.device | str | None = None,
        save_planner: SavePlanner | None = None,
        storage_writer_factory: Callable[[Path], StorageWriter] | None = None,
        load_planner: LoadPlanner | None = None,
    ) -> None:
        self.config = config
        self.model_provider = model
        self.task = task
        self.events = EventBus()
        self.state = TrainerState()
        self.run_dir = Path(config.run.run_dir)
        self._stop_requested = False
        self._resumed = False  # resume() ran (it loads at most once)
        self._resumed_from: Path | None = None  # the checkpoint resume() loaded
        self._consecutive_skips = 0  # skipped steps since the last applied one (not checkpointed)

        self.device = pick_device(device if device is not None else config.device_type())
        self._owns_ctx = ctx is None  # close() destroys the process groups of a context built here
        self.ctx, self.topology = connect(ctx, config.mesh, self.device, config.timeouts.init_s)
        topo = self.topology
        # One job per run directory: the main rank holds its lock until close() (or an error here).
        self._run_lock = lock_run_dir(self.run_dir) if topo.is_main else None
        self.checkpoints: TrainingCheckpoints | None = None
        try:
            self.log = setup_logging(mesh_prefix(topo.rank, topo.coords, topo.sizes), config.logging.level)
            self.reporter = RunReporter(
                config,
                self.run_dir,
                is_main=topo.is_main,
                trackers=trackers,
                run_ids=self.state.tracker_run_ids,
            )
            self.batch_plan = BatchPlan.from_config(config)
            # Process-global: deterministic algorithms (if asked) and the seed of the initial weights.
            apply_determinism(config.determinism, config.run.seed)

            # Model: this rank's stages, built on meta, parallelized, materialised, with initial weights.
            self.schedule = self.batch_plan.schedule(config.pipeline) if topo.pp_size > 1 else None
            self.num_stages, self.stage_indices = place_stages(self.schedule, topo)
            self.model_parts = build_stages(
                model, config, self.ctx, topo, self.stage_indices, self.num_stages, self.device
            )
            # listed once: walking the modules for them twice a step costs the host ~1 ms per step
            self._all_parameters = [p for part in self.model_parts for p in part.parameters()]
            # the stages whose next step's first FSDP2 all-gathers start at a step's end (fsdp.prefetch_units)
            self._prefetched = [
                part for part in self.model_parts if any(isinstance(m, FSDPModule) for m in part.modules())
            ]

            # The model's own update after each optimizer step (e.g. MoE routers' expert biases); bound
            # here so that a provider without it fails now, not after the first step.
            after_step = model.after_optimizer_step
            self.subscribe(AfterOptimizerStep, lambda e: after_step(self.model_parts, self.ctx))

            # Optimizers (one per model part, so state dicts stay keyed by FQN) and LR schedule.
            opt_factory = optimizer or (lambda module, cfg: build_optimizer(cfg.optimizer, module))
            self.optimizers = [opt_factory(part, config) for part in self.model_parts]
            self.lr_scheduler: LRScheduler
            if lr_scheduler is not None:
                self.lr_scheduler = lr_scheduler(self.optimizers, config)
            else:
                self.lr_scheduler = PiecewiseLR(self.optimizers, config.lr_schedule, config.run.steps)

            # One executor runs every step; the loss object collects the step's statistics.
            self.loss = StepLoss(task, self.device)
            self.executor = self._build_executor(self.loss)
            self.data_loader = data.build_loader(config, self.batch_plan, topo.dp_rank)
            self.evaluator: Evaluator | None = None
            if config.evaluation.enabled:
                self.evaluator = Evaluator.for_training(
                    config, data, self.batch_plan, topo, task, self.model_parts, self.device,
                    lambda loss: self._build_executor(loss, forward_only=True),
                )  # fmt: skip

            # Metrics are reduced over the whole world: replicas (tp, cp) scale numerator and weight alike.
            self.metrics = MetricCollection(group=None)
            self.metrics.add("loss", Mean())
            self.metrics.add("grad_norm", Mean())
            self.metrics.add("grad_norm_max", Max())
            flops = model.flops_per_token(config.batching.seq_len)
            # No MFU without a meaningful peak: a CPU has none (set logging.peak_flops to have one).
            peak = config.logging.peak_flops or peak_flops_for(self.device)
            self.throughput = ThroughputMeter(flops, peak, topo.world_size)
            self.gc = GCController(config.gc)
            self.profiler = StepProfiler(config.profiling, self.run_dir / "profile", topo.rank)
            self.rng = RngState()
            # The CPU group over all ranks (gloo): checkpoint coordination, the stop signal, token counts.
            self.host_group = self.ctx.host_group if dist.is_initialized() else None
            # Self-healing runs: a heartbeat file, stragglers in the metrics, a step watchdog (plait.loop.resilience).
            self.heartbeat = Heartbeat.for_run(
                self.run_dir, config.logging.heartbeat_interval_s, self.events, is_main=topo.is_main
            )
            self.stragglers = StragglerMeter(
                self.host_group, config.logging.straggler_threshold, rank=topo.rank, is_main=topo.is_main,
                events=self.events,
            )  # fmt: skip
            self.watchdog = StepWatchdog(
                config.timeouts, self.events, sync_every=config.logging.interval, rank=topo.rank,
                run_dir=self.run_dir,
            )  # fmt: skip
            if config.checkpoint.enabled:
                self.checkpoints = TrainingCheckpoints(
                    config,
                    self.app_state,
                    self.events,
                    process_group=self.host_group,
                    save_planner=save_planner,
                    storage_writer_factory=storage_writer_factory,
                    load_planner=load_planner,
                )
            self._last_lr = math.nan
            self.stop_signal: int | None = None  # the signal that stopped fit() early, if one did
            # printed and written by close()
            self.run_summary = RunSummaryCollector(self.events, mfu=self.throughput.mfu, is_main=topo.is_main)
        except BaseException:
            try:
                if self.checkpoints is not None:  # stop its writer process
                    self.checkpoints.close()
            finally:
                if self._run_lock is not None:
                    self._run_lock.release()
                if self._owns_ctx:  # the process groups this constructor created
                    self.ctx.shutdown()
            raise

    # ------------------------------------------------------------------ setup helpers
    def resume(self) -> Path | None:
        """Load the newest intact checkpoint of the run directory into the training state, once.

        :meth:`fit` calls it before its first step; call it yourself to see the resumed ``step``,
        weights, data position or LR schedule before :meth:`fit`. Only the first call loads (later
        calls return what it returned), and nothing is loaded without ``checkpoint.enabled`` and
        ``checkpoint.resume``. After the load, the config's optimizer hyper-parameters (lr, weight
        decay, betas, eps, ...) are applied over the ones the optimizer's saved state brought back, and
        the schedule to them: the run's config wins for every field a resume may change. A collective:
        every rank calls it. After an error, :meth:`close` the trainer (it releases the run directory).

        Returns:
            The checkpoint loaded, or None when none was.

        Raises:
            ResumeConfigError: the checkpoint's config differs in a field of ``fixed_on_resume``, or it
                is past ``run.steps``.
            CheckpointDamagedError: the newest checkpoint is damaged and ``checkpoint.on_damaged`` is
                ``"stop"``.
        """
        if not self._resumed:
            self._resumed_from = self._load_newest(self.checkpoints) if self.checkpoints is not None else None
            self._resumed = True
        return self._resumed_from

    def _load_newest(self, checkpoints: TrainingCheckpoints) -> Path | None:
        fresh = [
            [{k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in g.items() if k != "params"}
             for g in opt.param_groups]
            for opt in self.optimizers
        ]  # fmt: skip
        resumed = checkpoints.resume()
        if resumed is None:
            return None
        for opt, groups in zip(self.optimizers, fresh):
            for group, values in zip(opt.param_groups, groups):
                group.update(values)
        self.lr_scheduler.load_state_dict(self.lr_scheduler.state_dict())  # re-applied to the new lr
        return resumed[0]

    def _after_backward(self, stage: int, microbatch: int) -> None:
        if stage == self.stage_indices[0]:
            self.events.publish(AfterBackward(self.step, microbatch))

    def _build_executor(self, loss: StepLoss, *, forward_only: bool = False) -> Executor:
        """The training executor, or a forward-only one on the same stages (for evaluation)."""
        stages = dict(zip(self.stage_indices, self.model_parts))
        hook = None if forward_only else self._after_backward
        return build_executor(
            stages, self.num_stages, loss, self.batch_plan, self.schedule, self.topology, self.device,
            forward_only=forward_only, on_backward=hook, fsdp_gather_once=self.config.fsdp.gather_once_per_step,
        )  # fmt: skip

    # ------------------------------------------------------------------ public API
    @property
    def step(self) -> int:
        """Completed optimizer steps (including skipped ones)."""
        return self.state.step

    @property
    def checkpointer(self) -> Checkpointer | None:
        """The run's :class:`~plait.loop.checkpoint.Checkpointer` (None unless ``checkpoint.enabled``)."""
        return self.checkpoints.checkpointer if self.checkpoints is not None else None

    def parameters(self) -> list[nn.Parameter]:
        """Trainable parameters of all local model parts."""
        return [p for p in self._all_parameters if p.requires_grad]

    def subscribe(self, event_type: type[E], fn: Callable[[E], None]) -> Callable[[], None]:
        """Shortcut for ``trainer.events.subscribe``; returns the unsubscribe function."""
        return self.events.subscribe(event_type, fn)

    def totals(self) -> RunTotals:
        """The run's counters now (step, skipped steps, tokens seen) and its newest complete checkpoint."""
        checkpointer = self.checkpointer
        return RunTotals(
            step=self.state.step,
            total_steps=self.config.run.steps,
            skipped_steps=self.state.skipped_steps,
            tokens_seen=self.state.tokens_seen,
            checkpoint=checkpointer.last_complete if checkpointer is not None else None,
        )

    def request_stop(self) -> None:
        """Finish the current step, then leave :meth:`fit` (e.g. from a SIGTERM handler)."""
        self._stop_requested = True

    def app_state(self) -> dict[str, Any]:
        """Every part of the training state as ``Stateful`` objects, for torch.distributed.checkpoint.

        Keys: ``model`` and ``optimizer`` (FQN-keyed, DTensors stay sharded: reshardable),
        ``lr_scheduler``, ``data`` (global, dp-size independent), ``metrics`` (running accumulators),
        ``trainer`` (step, skipped steps, tokens seen, tracker run ids) — identical on all ranks or
        sharded DTensors — ``rng`` (every rank's generators, keyed ``rank<N>``) and, with evaluation
        on, ``validation_data`` (the validation loader's position).
        """
        state: dict[str, Any] = {
            "model": ModelState(self.model_parts),
            "optimizer": OptimizerState(self.model_parts, self.optimizers),
            "lr_scheduler": self.lr_scheduler,
            "data": self.data_loader,
            "metrics": PerRankState(self.metrics),
            "trainer": self.state,
            "rng": self.rng,
        }
        if self.evaluator is not None:
            state["validation_data"] = self.evaluator.loader
        return state

    def evaluate(self) -> dict[str, float]:
        """``val_loss`` and ``val_ppl`` of ``config.evaluation.steps`` validation batches (collective)."""
        if self.evaluator is None:
            raise RuntimeError("evaluation.enabled is false: no validation data")
        return self.evaluator.evaluate()

    # ------------------------------------------------------------------ the step
    def forward_backward(self, batch: Batch) -> tuple[LossStats, int, int]:
        """Forward and backward of this rank's step batch, gradients synchronised over dp.

        The executor splits ``batch`` into the plan's microbatches; each microbatch's objective is
        divided by the step's global loss-token count, so the accumulated gradient is the
        token-weighted mean over all microbatches of all dp ranks. Under context parallelism the
        tokens are counted on the whole ``batch`` (the same on every rank of a context group), then
        every stage gets this rank's sequence shard (:meth:`Topology.shard_batch`); the model's loss
        sums are this rank's and FSDP sums the gradients over the context ranks.

        Returns:
            ``(local loss statistics (device tensors), global loss tokens, global positions)``.
        """
        local = [self.task.num_loss_tokens(batch), max(v.numel() for v in batch.values())]
        global_tokens, positions = self._sum_over_dp(local)
        if global_tokens == 0:
            raise ValueError(
                f"step {self.step}: the global batch has no loss tokens (all labels are ignored)"
            )
        state = PipelineState(self.batch_plan.num_microbatches, specs={LOSS_KEY: Stack()})
        for k, v in self.topology.shard_batch(batch).items():
            state.global_view[k] = v.to(self.device, non_blocking=True)
        self.loss.start(global_tokens)
        self.events.publish(BeforeForwardBackward(self.step, state.num_microbatches, global_tokens))
        self.executor.step({}, state)
        if self.topology.dp_size > 1:
            all_reduce_plain_grads(self.parameters(), self.topology.dp_group, self.config.gradients)
        self.events.publish(AfterForwardBackward(self.step))
        return self.loss.stats, global_tokens, positions

    def train_step(self, batch: Batch) -> StepResult:
        """One optimizer step on this rank's step batch, its statistics read on the host (one sync)."""
        return self._settle(self._launch(batch))

    def _launch(self, batch: Batch) -> PendingStep:
        """Queue the step's device work: forward/backward, clipping, the optimizer step.

        The step's statistics stay on the device; :meth:`_settle` reads them. Only the ``skip`` policy
        for non-finite values reads them here, since it must know before the optimizer step.
        """
        cfg, step = self.config, self.step
        stats, global_tokens, positions = self.forward_backward(batch)
        # An optimizer that declares ``step_takes_grad_scale`` (StochasticAdamW) scales each gradient as its
        # step reads it: when every optimizer does, the clipping factor goes to their steps instead of a
        # pass that rewrites the gradients.
        clip, pp_group = cfg.grad_clip, self.topology.pp_group
        in_step = all(getattr(opt, "step_takes_grad_scale", False) for opt in self.optimizers)
        grad_scale = None
        if clip.max_norm is not None and in_step:
            norm = clip_grad_norm(self.parameters(), None, clip.norm_type, pp_group)
            grad_scale = clip_factor(norm, clip.max_norm)
        else:
            norm = clip_grad_norm(self.parameters(), clip.max_norm, clip.norm_type, pp_group)
        lr = self.lr_scheduler.get_last_lr()[0]
        pending = PendingStep(step, stats.pack(norm), lr, global_tokens)
        if cfg.determinism.nonfinite_loss == "skip":
            reading = pending.packed.read()
            pending.skipped = not (math.isfinite(reading.loss) and math.isfinite(reading.grad_norm))
            if pending.skipped:
                self._skip(step, f"loss={reading.loss}, grad_norm={reading.grad_norm}", reading.loss)
        if not pending.skipped:
            self._consecutive_skips = 0
            self.events.publish(BeforeOptimizerStep(step, norm, grad_scale))
            if self.checkpointer is not None:  # a pending save may still be copying these tensors
                self.checkpointer.wait_for_staging()
            for opt in self.optimizers:
                if grad_scale is None:
                    opt.step()
                else:
                    opt.step(grad_scale=grad_scale)  # type: ignore[call-overload]  # the declared capability
        self.lr_scheduler.step()  # the schedule follows the step count, skipped steps included
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        if not pending.skipped:
            self.events.publish(AfterOptimizerStep(step, lr))
        self._last_lr = lr
        self.state.step += 1
        self.state.tokens_seen += positions
        self.throughput.add(positions)
        return pending

    def _settle(self, pending: PendingStep) -> StepResult:
        """Read a launched step's statistics (a device sync unless already read) into the metrics.

        Raises:
            FloatingPointError: a non-finite loss or gradient norm under the ``raise`` policy.
        """
        reading = pending.packed.read()
        loss, grad_norm = reading.loss, reading.grad_norm
        if not pending.skipped and not (math.isfinite(loss) and math.isfinite(grad_norm)):
            self._skip(pending.step, f"loss={loss}, grad_norm={grad_norm}", loss)  # raises under `raise`
        for name, (value, weight) in reading.metrics.items():
            self.metrics.update(name, value, weight)
        if not pending.skipped:
            tokens = reading.local_tokens
            self.metrics.update("loss", reading.local_loss_sum / tokens if tokens else 0.0, tokens)
            self.metrics.update("grad_norm", grad_norm)
            self.metrics["grad_norm_max"].update(grad_norm)  # type: ignore[union-attr]
        return StepResult(loss, grad_norm, pending.lr, pending.global_tokens, pending.skipped)

    def _skip(self, step: int, what: str, loss: float) -> None:
        if self.config.determinism.nonfinite_loss == "raise":
            raise FloatingPointError(f"non-finite {what} at step {step} on rank {self.topology.rank}")
        self.state.skipped_steps += 1
        self._consecutive_skips += 1
        self.events.publish(StepSkipped(step, loss, self.state.skipped_steps))
        det = self.config.determinism
        limit = det.max_skipped_steps
        if limit is not None and self.state.skipped_steps > limit:
            raise FloatingPointError(
                f"{self.state.skipped_steps} steps skipped for non-finite values (last: {what} at step "
                f"{step} on rank {self.topology.rank}), more than determinism.max_skipped_steps={limit}"
            )
        run_limit = det.max_consecutive_skipped_steps
        if run_limit is not None and self._consecutive_skips >= run_limit:
            raise FloatingPointError(
                f"{self._consecutive_skips} steps in a row skipped for non-finite values (last: {what} at "
                f"step {step} on rank {self.topology.rank}): the run has diverged "
                f"(determinism.max_consecutive_skipped_steps={run_limit})"
            )

    def check_finite(self, what: str) -> None:
        """Raise unless every parameter of every rank is finite (a collective over all ranks).

        Args:
            what: what the check guards, for the message (e.g. ``"checkpoint step 3"``).

        Raises:
            FloatingPointError: naming the step, up to five non-finite parameters of this rank and ``what``.
        """
        from torch.distributed.tensor import DTensor

        named = [
            (n, t)
            for part in self.model_parts
            for n, p in part.named_parameters()
            if (t := p.to_local() if isinstance(p, DTensor) else p).numel() and t.is_floating_point()
        ]
        # min and max are NaN when any value is, +-inf when any value is: one pass, no mask (7x
        # faster than isfinite().all() on CPU)
        extremes = [torch.stack(torch.aminmax(t.detach())).float() for _, t in named]  # dtypes differ
        flags = torch.isfinite(torch.stack(extremes)).all(1).cpu() if named else torch.ones(0)
        bad = [n for (n, _), ok in zip(named, flags.tolist()) if not ok]
        count = torch.tensor([len(bad)], dtype=torch.int64)
        if dist.is_initialized():
            if self.host_group is None and dist.get_backend() == "nccl":
                count = count.to(self.device)
            dist.all_reduce(count, group=self.host_group)
        if int(count.item()):
            where = (
                f"here: {', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''}" if bad else "on another rank"
            )
            raise FloatingPointError(
                f"non-finite parameters after step {self.step} ({where}; rank {self.topology.rank}): the run "
                f"has diverged; {what} not written"
            )

    def _sum_over_dp(self, values: list[int]) -> tuple[int, ...]:
        """Sum host integers over the data-parallel ranks without touching the device.

        The sum runs on the host (gloo) group over the whole world: every rank that shares a dp index
        holds the same step batch, so the world sum is ``world_size / dp_size`` times the dp sum. An
        all-reduce on the NCCL dp group would make the host wait, every step, for the device to
        finish the previous step (a host read after a device collective), so the host could not run
        ahead. Without a host group (a context that has none) it falls back to the dp group.
        """
        topo = self.topology
        if topo.dp_size == 1 or not dist.is_initialized():
            return tuple(values)
        t = torch.tensor(values, dtype=torch.float64)
        host = self.host_group
        if host is not None and dist.get_backend(host) == "gloo":
            t0 = time.perf_counter()
            dist.all_reduce(t, group=host)
            self.stragglers.add_sync_wait(time.perf_counter() - t0)  # waiting here for a late rank
            return tuple(int(v) // (topo.world_size // topo.dp_size) for v in t.tolist())
        if dist.get_backend(topo.dp_group) == "nccl":
            t = t.to(self.device)
        dist.all_reduce(t, group=topo.dp_group)
        return tuple(int(v) for v in t.tolist())

    # ------------------------------------------------------------------ the run
    def _log(self, *, train: bool, evaluate: bool) -> None:
        values: dict[str, float] = {}
        if train:
            values = self.metrics.compute(sync=True)
            values["lr"] = self._last_lr
            values.update(self.throughput.measure())
            values.update(device_memory_stats(self.device))
            values["skipped_steps"] = float(self.state.skipped_steps)
            values["tokens_seen"] = float(self.state.tokens_seen)
            values.update(self.stragglers.gather())  # a small all-gather on the host group
            self.metrics.reset()
        if evaluate:
            t0 = time.perf_counter()
            with self.watchdog.phase("evaluation", self.step), self.heartbeat.phase("evaluation", self.step):
                values.update(self.evaluate())
            self.throughput.exclude(time.perf_counter() - t0)
        self.reporter.log(values, self.step)
        interval = self.throughput.last_interval if train else None
        self.events.publish(MetricsLogged(self.step, values, interval))

    def fit(self, steps: int | None = None) -> dict[str, float]:
        """Train until ``steps`` (default ``config.run.steps``) optimizer steps are done, or a stop request.

        A normal return means every parameter is finite (checked at the end, and before every
        checkpoint), so a model exported after it holds no NaN or inf.

        Returns:
            The last logged metrics (with ``val_loss`` / ``val_ppl`` of the last evaluation).

        Raises:
            FloatingPointError: a non-finite loss, gradient norm (policy ``raise``, or too many
                skipped steps under ``skip``) or parameter.
            ResumeConfigError: from :meth:`resume`, which the first call runs before its first step.
        """
        total = steps if steps is not None else self.config.run.steps
        set_collective_timeout(self.config.timeouts.init_s, self.topology.groups, self.ctx)
        self.resume()  # the first fit() loads the newest checkpoint: the run goes on from its step
        last_logged: dict[str, float] = {}
        unsub = self.events.subscribe(MetricsLogged, lambda e: last_logged.update(e.metrics))
        self.reporter.open(total, self.step)
        self.gc.start()
        self.profiler.start()
        self.events.publish(TrainingStart(self.step, total, self.state.tokens_seen))
        preemption = self._preemption_handler()
        first = True
        queued: list[PendingStep] = []  # launched steps whose statistics are still on the device
        last_loss = math.nan
        self.watchdog.start()
        try:
            while self.step < total and not self._stop_requested:
                self.events.publish(StepStart(self.step))
                t0 = time.perf_counter()
                self.stragglers.delay()  # PLAIT_DEBUG_RANK_DELAY's test hook; nothing without it
                t_data = time.perf_counter()
                batch = next(self.data_loader)
                data_wait = time.perf_counter() - t_data
                self.throughput.add_data_wait(data_wait)
                self.stragglers.add_data_wait(data_wait)
                pending = self._launch(batch)
                queued.append(pending)
                if self.step < total and (units := self.config.fsdp.prefetch_units):
                    for part in self._prefetched:  # the next step's first all-gathers, behind this step
                        prefetch_all_gathers(part, units)
                self.gc.step(self.step)
                self.profiler.step()
                if first:
                    set_collective_timeout(self.config.timeouts.step_s, self.topology.groups, self.ctx)
                    first = False
                if preemption is not None and preemption.should_stop():
                    self._stop_requested = True
                log = self.step % self.config.logging.interval == 0 or self.step == total
                evaluate = self.evaluator is not None and self.evaluator.due(self.step, total)
                last = self.step == total or self._stop_requested
                save = self.checkpoints is not None and self.checkpoints.due(self.step, last=last)
                # Statistics are read once per logging interval (and before an evaluation or a save),
                # so that the host runs ahead of the device between reads.
                if log or evaluate or save or last:
                    last_loss = [self._settle(p) for p in queued][-1].loss
                    queued.clear()
                    if log or evaluate:
                        self._log(train=log, evaluate=evaluate)
                seconds = time.perf_counter() - t0
                self.reporter.step_done(last_loss, seconds)
                self.events.publish(
                    StepEnd(
                        self.step, StepMetrics(pending), lr=pending.lr, loss_tokens=pending.global_tokens,
                        tokens_seen=self.state.tokens_seen, skipped=pending.skipped, seconds=seconds,
                    )
                )  # fmt: skip
                if last and self._consecutive_skips:
                    raise FloatingPointError(
                        f"the run ended on {self._consecutive_skips} skipped step(s) in a row (non-finite loss or "
                        f"gradients up to step {self.step}): the model has diverged; no checkpoint or export of it"
                    )
                if save:
                    with (
                        self.watchdog.phase("checkpoint", self.step),
                        self.heartbeat.phase("checkpoint", self.step),
                    ):
                        self.save_checkpoint(blocking=last)
            self.check_finite("the end of fit() (so no export)")
            self.events.publish(TrainingEnd(self.step, stopped_early=self.step < total))
        except Exception as e:  # a KeyboardInterrupt is a stop, not a failure
            self.run_summary.failed(e)
            self.heartbeat.beat(self.step, "failed", force=True)
            raise
        finally:
            self.watchdog.stop()
            if preemption is not None:
                self.stop_signal = preemption.received
                preemption.restore()
            self.profiler.stop()
            self.gc.stop()
            unsub()
            self.reporter.close_bar()
        return last_logged

    # ------------------------------------------------------------------ checkpoints
    def _preemption_handler(self) -> PreemptionHandler | None:
        """SIGTERM/SIGINT end the run after the current step (``checkpoint.save_on_signal``): with
        checkpointing on, after saving it; with it off, the run still stops cleanly (summary, exit status)."""
        if self.checkpoints is not None:
            return self.checkpoints.preemption_handler()
        ck = self.config.checkpoint
        return PreemptionHandler(ck.grace_period_s, self.host_group) if ck.save_on_signal else None

    def save_checkpoint(self, *, blocking: bool = False) -> None:
        """Save the whole training state as checkpoint ``self.step`` (async unless ``blocking``).

        Raises:
            FloatingPointError: a parameter is not finite (:meth:`check_finite`): nothing is saved.
        """
        if self.checkpoints is None:
            raise RuntimeError("checkpoint.enabled is false: no checkpointer")
        self.check_finite(f"checkpoint step {self.step}")
        self.checkpoints.save(self.step, blocking=blocking)

    def close(self) -> None:
        """Finish pending checkpoint writes, close the trackers, print and write the run summary
        (``summary.json``, ``loss_curve.png``; call once after the last :meth:`fit`), release the run
        directory's lock, then destroy the process groups of a context the trainer built itself (also
        when one of the former fails)."""
        try:
            if self.checkpoints is not None:
                self.checkpoints.close()
            self.reporter.close()
            self.run_summary.write(self.run_dir, self.totals())
        finally:
            if self._run_lock is not None:
                self._run_lock.release()
            if self._owns_ctx:
                self.ctx.shutdown()
