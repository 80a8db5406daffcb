"""The sections of :class:`TrainerConfig`: one frozen pydantic model per concern."""

from __future__ import annotations

from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

__all__ = [
    "OPTIMIZER_NAMES",
    "AdamWConfig",
    "BatchingConfig",
    "CheckpointConfig",
    "DeterminismConfig",
    "EvaluationConfig",
    "FSDPConfig",
    "GCConfig",
    "GradClipConfig",
    "GradientConfig",
    "LoggingConfig",
    "OptimizerConfig",
    "PipelineConfig",
    "ProfilingConfig",
    "RunConfig",
    "SGDConfig",
    "StochasticAdamWConfig",
    "TimeoutConfig",
    "TrackerConfig",
    "WatchdogConfig",
]


class _Section(BaseModel):
    # Every float must be finite (inf and NaN are refused, naming the field) unless a field says otherwise.
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


Beta = Annotated[float, Field(ge=0, lt=1)]


class RunConfig(_Section):
    """Name, output directory and length of the run."""

    name: str = Field(
        default="run",
        description="Run name: the progress bar's label, the default tracker project, in checkpoint metadata.",
    )
    run_dir: str = Field(
        default="runs/run",
        description="Output directory (metrics, checkpoints, profiles, heartbeat), locked by one job.",
    )
    steps: int = Field(default=100, ge=1, description="Number of optimizer steps of the whole run.")
    seed: int = Field(
        default=0, description="Seed of torch's default generators (initial weights) and data shuffling."
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        default="auto", description="Device to train on; auto: cuda when available, else cpu."
    )


class BatchingConfig(_Section):
    """Global batch and microbatch sizes, counted in sequences (samples).

    Every count derived from them (per-rank batch, microbatches per step) is computed once, by
    :class:`~plait.loop.BatchPlan`.
    """

    global_batch_size: int = Field(default=8, ge=1, description="Samples per optimizer step, all ranks.")
    microbatch_size: int = Field(default=1, ge=1, description="Samples per forward/backward on one rank.")
    seq_len: int = Field(default=128, ge=1, description="Tokens per sample (sequence length).")


class PipelineConfig(BaseModel):
    """The pipeline schedule, used when ``mesh.pipeline > 1``: a ``kind`` registered in plait.pipelining
    (``1f1b`` by default; ``plait.pipelining.registered_schedules()`` lists them, a user's
    ``register_schedule`` kinds included) and its own options (e.g. ``stages_per_rank``), checked by
    :meth:`~plait.loop.BatchPlan.schedule`.

    The microbatch count is the :class:`~plait.loop.BatchPlan`'s; ``num_microbatches``, when given,
    must equal it.
    """

    model_config = ConfigDict(frozen=True, extra="allow", allow_inf_nan=False)

    kind: str = Field(default="1f1b", description="Name of a schedule registered in plait.pipelining.")
    num_microbatches: int | None = Field(
        default=None, ge=1, description="Microbatches per step; must equal the batch plan's (None: take it)."
    )


class EvaluationConfig(_Section):
    """Validation loss on held-out data (the data provider's validation loader), forward only.

    Every ``interval`` steps and after the last step, ``steps`` global batches are evaluated through
    the training executor's stages; the token-weighted ``val_loss`` and ``val_ppl`` = exp(val_loss)
    go to the trackers, the console and :meth:`~plait.loop.Trainer.fit`'s result.
    """

    enabled: bool = Field(
        default=False, description="Evaluate the validation loss (needs a validation loader from the data)."
    )
    interval: int | None = Field(
        default=None, ge=1, description="Evaluate every N steps (None: at the end only)."
    )
    steps: int = Field(default=1, ge=1, description="Global batches per evaluation.")


class AdamWConfig(_Section):
    """``torch.optim.AdamW``; ``fused=None`` picks the fused kernel where the device supports it."""

    name: Literal["adamw"] = Field(
        default="adamw",
        description="Optimizer: adamw, stochastic_adamw or sgd (a section without it is adamw).",
    )
    lr: float = Field(default=3e-4, gt=0, description="Peak learning rate; lr_schedule scales it.")
    betas: tuple[Beta, Beta] = Field(
        default=(0.9, 0.95), description="Adam's (beta1, beta2) moment decay rates, each in [0, 1)."
    )
    eps: float = Field(
        default=1e-8, gt=0, description="Term added to the denominator for numerical stability."
    )
    weight_decay: float = Field(default=0.1, ge=0, description="Decoupled weight decay coefficient.")
    fused: bool | None = Field(
        default=None,
        description="Use torch's fused AdamW kernel (None: when every parameter is on an accelerator).",
    )
    no_decay_norms_biases_embeddings: bool = Field(
        default=True, description="Exempt norm weights, biases and embeddings from weight decay."
    )


class StochasticAdamWConfig(_Section):
    """plait.kernels' ``StochasticAdamW`` (stochastic rounding into bf16 parameters)."""

    name: Literal["stochastic_adamw"] = Field(
        default="stochastic_adamw", description="Optimizer: adamw, stochastic_adamw or sgd."
    )
    lr: float = Field(default=3e-4, gt=0, description="Peak learning rate; lr_schedule scales it.")
    betas: tuple[Beta, Beta] = Field(
        default=(0.9, 0.95), description="Adam's (beta1, beta2) moment decay rates, each in [0, 1)."
    )
    eps: float = Field(
        default=1e-8, gt=0, description="Term added to the denominator for numerical stability."
    )
    weight_decay: float = Field(default=0.1, ge=0, description="Decoupled weight decay coefficient.")
    moment_dtype: Literal["float32", "bfloat16"] = Field(
        default="float32", description="dtype of the Adam moments (exp_avg, exp_avg_sq)."
    )
    seed: int = Field(
        default=0,
        description=(
            "Seed of the stochastic rounding; the same on every data-parallel replica keeps replicated "
            "bf16 parameters bit-identical."
        ),
    )
    no_decay_norms_biases_embeddings: bool = Field(
        default=True, description="Exempt norm weights, biases and embeddings from weight decay."
    )


class SGDConfig(_Section):
    """``torch.optim.SGD``."""

    name: Literal["sgd"] = Field(default="sgd", description="Optimizer: adamw, stochastic_adamw or sgd.")
    lr: float = Field(default=1e-2, gt=0, description="Peak learning rate; lr_schedule scales it.")
    momentum: float = Field(default=0.0, ge=0, description="Momentum factor (0: plain SGD).")
    nesterov: bool = Field(default=False, description="Nesterov momentum (needs momentum > 0).")
    weight_decay: float = Field(
        default=0.0, ge=0, description="L2 penalty added to the gradients (torch.optim.SGD's weight_decay)."
    )
    no_decay_norms_biases_embeddings: bool = Field(
        default=True, description="Exempt norm weights, biases and embeddings from weight decay."
    )

    @model_validator(mode="after")
    def _nesterov_needs_momentum(self) -> SGDConfig:
        if self.nesterov and self.momentum == 0:
            raise ValueError("optimizer.nesterov=true needs optimizer.momentum > 0")
        return self


def _name_of(section: type[BaseModel]) -> str:
    """The optimizer name a section declares (its ``name`` literal)."""
    return str(section.model_fields["name"].default)


def _optimizer_name(value: Any) -> str:
    # A section without ``name`` is AdamW, so ``--optimizer.lr=...`` alone works.
    if isinstance(value, dict):
        return str(value.get("name", _name_of(AdamWConfig)))
    return str(getattr(value, "name", _name_of(AdamWConfig)))


OptimizerConfig = Annotated[
    Annotated[AdamWConfig, Tag(_name_of(AdamWConfig))]
    | Annotated[StochasticAdamWConfig, Tag(_name_of(StochasticAdamWConfig))]
    | Annotated[SGDConfig, Tag(_name_of(SGDConfig))],
    Discriminator(_optimizer_name),
]
# Every optimizer's name, read from the union above: the one list of optimizers.
OPTIMIZER_NAMES: tuple[str, ...] = tuple(
    _name_of(get_args(m)[0]) for m in get_args(get_args(OptimizerConfig)[0])
)


class GradClipConfig(_Section):
    """Global gradient-norm clipping (DTensor-aware); ``max_norm=None`` only measures the norm."""

    max_norm: float | None = Field(
        default=1.0, gt=0, description="Clip the global gradient norm to this (None: only measure it)."
    )
    norm_type: float = Field(
        default=2.0, gt=0, allow_inf_nan=True, description="p of the p-norm; inf: max norm"
    )


class GradientConfig(_Section):
    """How the loop sums the data-parallel gradients of plain (non-DTensor) parameters.

    FSDP2/DTensor parameters are reduced by the model's own parallel plan (for plait.models:
    ``parallel.reduce_dtype``), not here.
    """

    reduce_dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        default=None, description="dtype the buckets are summed in; None: the gradients' own dtype"
    )
    bucket_size_mb: float = Field(default=25.0, gt=0, description="flat all-reduce bucket size in MiB")


class FSDPConfig(_Section):
    """How a step treats the FSDP2 modules of the model's stages (the model's parallel plan shards them;
    without FSDP2 modules nothing here has an effect)."""

    gather_once_per_step: bool = Field(
        default=False,
        description=(
            "MaxText's all_gather_over_fsdp: all-gather each FSDP2 module once per step and keep its parameters "
            "unsharded over all microbatches (resharded at the step's end), instead of gathering them in every "
            "microbatch; fewer all-gathers for the memory of the unsharded stages held over the step"
        ),
    )
    prefetch_units: int = Field(
        default=0,
        ge=0,
        description=(
            "after each optimizer step (and its AfterOptimizerStep subscribers) but the run's last, start the "
            "all-gathers of each stage's first N FSDP2 units in module order (a decoder stage's root, token "
            "embedding and first decoder layers), so that they run while the host prepares the next step instead "
            "of holding up its first layers; 0 (default: no gain measured with CUDA graphs on 2 GPUs): each is "
            "gathered when the next forward reaches it"
        ),
    )


class CheckpointConfig(_Section):
    """Checkpointing of the whole training state (see :mod:`plait.loop.checkpoint`).

    Saves every ``interval`` steps, at the last step, and on SIGTERM/SIGINT (``save_on_signal``:
    the current step finishes, a final checkpoint is written, the process exits within
    ``grace_period_s``). With ``resume`` the newest complete checkpoint in ``dir`` is loaded when the
    trainer is built; a damaged one (a file missing, truncated, or with ``checksums`` corrupt) is
    named and skipped for the previous one (``on_damaged="fall_back"``) or stops the run.
    """

    enabled: bool = Field(default=False, description="Save checkpoints (and resume from them).")
    interval: int | None = Field(default=None, ge=1, description="Save every N steps (and at the last step).")
    keep_last: int = Field(
        default=3, ge=1, description="Complete checkpoints kept; older ones are deleted after a save."
    )
    async_mode: Literal["process", "thread", "off"] = Field(
        default="process", description="Write from a background process, a thread, or synchronously."
    )
    dir: str | None = Field(default=None, description="Defaults to <run_dir>/checkpoints.")
    resume: bool = Field(
        default=True, description="Load the newest intact checkpoint in dir before the first step."
    )
    save_on_signal: bool = Field(
        default=True, description="On SIGTERM/SIGINT finish the step, save a final checkpoint and exit."
    )
    grace_period_s: float = Field(
        default=120.0, gt=0, description="After a stop signal, the process is ended after this many seconds."
    )
    checksums: bool = Field(
        default=False,
        description="Record a CRC32 of every checkpoint file and verify it at resume (sizes are always checked).",
    )
    on_damaged: Literal["fall_back", "stop"] = Field(
        default="fall_back",
        description="A damaged newest checkpoint at resume: warn and use the previous one, or stop with an error.",
    )
    coordinator_rank: int = Field(
        default=0,
        ge=0,
        description="The rank that gathers DCP's plans and writes its metadata (< world size; not 0 needs async_mode='off').",
    )


class TrackerConfig(_Section):
    """One experiment tracker: ``jsonl`` (default), ``console``, ``tensorboard``, ``aim``, ``wandb``."""

    kind: Literal["jsonl", "console", "tensorboard", "aim", "wandb"] = Field(
        description="Tracker: jsonl (<run_dir>/metrics.jsonl), console, tensorboard, aim or wandb."
    )
    project: str | None = Field(
        default=None, description="aim experiment or wandb project name (None: run.name)."
    )
    options: dict[str, str | int | float | bool] = Field(
        default_factory=dict,
        description="Extra keyword arguments of the tracker (jsonl: filename; wandb: mode, default offline).",
    )


class LoggingConfig(_Section):
    """How often metrics are logged, and where."""

    interval: int = Field(
        default=1,
        ge=1,
        description="Log metrics every N steps (and the last); device statistics are read that often.",
    )
    trackers: tuple[TrackerConfig, ...] = Field(
        default=(TrackerConfig(kind="jsonl"), TrackerConfig(kind="console")),
        description="[[logging.trackers]] tables: the experiment trackers the main rank logs to.",
    )
    progress_bar: bool = Field(default=True, description="Show a tqdm progress bar on the main rank.")
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        default="INFO", description="Level of the plait logger."
    )
    peak_flops: float | None = Field(
        default=None,
        gt=0,
        description="Peak FLOP/s per device for MFU; None looks a CUDA device up (its bf16 data-sheet peak), "
        "and a CPU has none: no MFU is shown (plait.loop.tracking.measure_matmul_flops measures one to set here).",
    )
    heartbeat_interval_s: float | None = Field(
        default=10.0,
        ge=0,
        description=(
            "The main rank rewrites <run_dir>/heartbeat.json (step, unix time, tokens seen, phase) after a step "
            "at most this often, and at the start and end of fit() (0: after every step; None: no heartbeat)"
        ),
    )
    straggler_threshold: float | None = Field(
        default=0.2,
        gt=0,
        description=(
            "Each logging interval the ranks' per-step host times are gathered (gloo); the slowest rank is "
            "logged (straggler_rank, straggler_lag_s) and warned about when its lag over the median exceeds this "
            "fraction of the median (0.2: 20%); None: not gathered"
        ),
    )


class ProfilingConfig(_Section):
    """torch.profiler window(s): skip ``wait`` steps, warm up, record ``active`` steps, ``repeat`` times."""

    enabled: bool = Field(
        default=False, description="Profile steps; one chrome trace per rank and window in <run_dir>/profile."
    )
    wait: int = Field(default=1, ge=0, description="Steps skipped at the start of each window.")
    warmup: int = Field(default=1, ge=0, description="Steps traced but discarded before recording.")
    active: int = Field(default=2, ge=1, description="Steps recorded per window.")
    repeat: int = Field(default=1, ge=0, description="Number of windows (0: repeat until training ends).")
    record_shapes: bool = Field(default=False, description="Record the input shapes of ops.")
    profile_memory: bool = Field(default=False, description="Track tensor memory allocations.")
    with_stack: bool = Field(default=False, description="Record the Python source location of ops.")


class WatchdogConfig(_Section):
    """The step watchdog (:class:`~plait.loop.resilience.StepWatchdog`): a thread that ends a rank whose
    training loop makes no progress, with exit status 75 (:data:`~plait.loop.resilience.WATCHDOG_EXIT_CODE`)
    so that torchrun or Slurm restart the job from its last complete checkpoint.

    After the warm-up a step may take ``step_factor`` times the longest recent step (at least
    ``min_step_s``); the warm-up steps, checkpoint saves and evaluations have limits of their own. The step
    limits stay below the collective timeout in force (90% of ``timeouts.init_s`` for a fit's first step,
    of ``timeouts.step_s`` after it), so a rank stuck in a collective is reported by the watchdog (phase,
    stacks, NCCL flight recorder) before the collective's own timeout fires.
    """

    enabled: bool | Literal["auto"] = Field(
        default="auto",
        description="true, false, or auto: on when launched by torchrun (TORCHELASTIC_RUN_ID set), which restarts it",
    )
    step_factor: float = Field(
        default=10.0, gt=1, description="A step may take this many times the longest of the recent steps."
    )
    min_step_s: float = Field(default=60.0, gt=0, description="The step limit is never below this (seconds).")
    warmup_steps: int = Field(
        default=3,
        ge=0,
        description=(
            "The first steps of each fit() (compilation, allocator warm-up) run under warmup_step_s; the "
            "warm-up also lasts until logging.interval steps after them were timed"
        ),
    )
    warmup_step_s: float = Field(default=900.0, gt=0, description="The limit of each warm-up step (seconds).")
    checkpoint_s: float = Field(
        default=1800.0, gt=0, description="The limit of one checkpoint save (seconds)."
    )
    evaluation_s: float = Field(default=1800.0, gt=0, description="The limit of one evaluation (seconds).")


class TimeoutConfig(_Section):
    """Collective timeouts: a long one for start-up (compilation, weight loading), a short one per step;
    and the step watchdog's limits (``watchdog``), kept below them."""

    init_s: float = Field(
        default=600.0,
        gt=0,
        description="Collective timeout (seconds) of start-up and of each fit()'s first step.",
    )
    step_s: float = Field(
        default=120.0, gt=0, description="Collective timeout (seconds) after each fit()'s first step."
    )
    watchdog: WatchdogConfig = WatchdogConfig()


class GCConfig(_Section):
    """Automatic garbage collection off; a full collection every ``interval`` steps on every rank."""

    disable_automatic: bool = Field(
        default=True, description="Turn Python's automatic garbage collection off for the run."
    )
    interval: int | None = Field(
        default=50, ge=1, description="Collect every N steps on every rank (None: never explicitly)."
    )
    generation: Literal[0, 1, 2] = Field(
        default=1,
        description="Oldest generation each collection covers (gc.collect's; 2: a full collection).",
    )


class DeterminismConfig(_Section):
    """Determinism and the NaN/Inf loss policy."""

    deterministic_algorithms: bool = Field(
        default=False,
        description="torch.use_deterministic_algorithms (ops without a deterministic kernel raise).",
    )
    nonfinite_loss: Literal["raise", "skip"] = Field(
        default="raise",
        description="A NaN/Inf loss or gradient norm: raise, or skip that step's optimizer update.",
    )
    max_skipped_steps: int | None = Field(
        default=None, ge=0, description="Raise once more steps than this were skipped."
    )
    max_consecutive_skipped_steps: int | None = Field(
        default=10,
        ge=1,
        description="Raise once this many steps in a row were skipped (the run has diverged).",
    )
