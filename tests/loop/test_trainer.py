"""The Trainer on CPU: falling loss (1 process and gloo DP=2), grad-accumulation equivalence,
tracker files, events, NaN policy, exact in-process resume through app_state, profiler traces."""

from __future__ import annotations

import copy
import json
import math
import time

import pytest
import torch
import torch.nn.functional as F
from plait.dist_core.testing import run_distributed
from plait.loop import (
    AfterOptimizerStep,
    BeforeForwardBackward,
    BeforeOptimizerStep,
    CausalLMTask,
    DatasetProvider,
    Event,
    MetricsLogged,
    ModuleProvider,
    StepEnd,
    StepSkipped,
    StepStart,
    Trainer,
    load_config,
    pack_documents,
)

from tests.loop._lm import VOCAB, MeshContext, TinyLM, pattern_tokens


def _config(tmp_path, *extra: str, steps: int = 12, dp: int = 1):
    return load_config(
        overrides=[
            f"--run.run_dir={tmp_path}",
            f"--run.steps={steps}",
            f"--mesh.data_shard={dp}",
            "--batching.global_batch_size=8",
            "--batching.microbatch_size=2",
            "--batching.seq_len=16",
            "--optimizer.lr=0.02",
            "--logging.progress_bar=false",
            *extra,
        ]
    )


def _dataset():
    return pack_documents(pattern_tokens(), 16, eos_id=VOCAB - 1)


def _trainer(cfg, task=None, **kw) -> Trainer:
    return Trainer(cfg, ModuleProvider(TinyLM), DatasetProvider(_dataset()), task or CausalLMTask(), **kw)


def _losses(trainer: Trainer) -> list[float]:
    out: list[float] = []
    trainer.subscribe(StepEnd, lambda e: out.append(e.metrics["loss"]))
    return out


def test_trains_on_one_process_and_writes_metrics(tmp_path):
    torch.set_num_threads(1)
    tr = _trainer(_config(tmp_path, "--logging.interval=4", steps=24))
    losses = _losses(tr)
    tr.fit()
    tr.close()
    assert tr.step == 24 and len(losses) == 24
    assert sum(losses[-4:]) / 4 < 0.75 * sum(losses[:4]) / 4
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [4, 8, 12, 16, 20, 24]
    for r in records:
        for key in ("loss", "lr", "grad_norm", "tokens_per_s"):
            assert isinstance(r[key], float) and math.isfinite(r[key]), key
    # The logged loss is the token-weighted mean over the interval's steps.
    assert records[-1]["loss"] == pytest.approx(sum(losses[-4:]) / 4, rel=0.05)
    assert json.loads((tmp_path / "config.json").read_text())["run"]["steps"] == 24


def _grads_after_forward_backward(
    tmp_path, microbatch_size: int
) -> tuple[dict[str, torch.Tensor], Trainer, dict[str, torch.Tensor]]:
    cfg = _config(tmp_path, f"--batching.microbatch_size={microbatch_size}")
    tr = _trainer(cfg)
    batch = next(tr.data_loader)
    tr.forward_backward(batch)
    return {n: p.grad.clone() for n, p in tr.model_parts[0].named_parameters()}, tr, batch


def test_grad_accumulation_equivalence(tmp_path):
    g_accum, tr, batch = _grads_after_forward_backward(tmp_path, 2)  # 4 microbatches x 2
    assert tr.batch_plan.num_microbatches == 4 and tr.executor.num_microbatches == 4
    g_one, tr1, batch1 = _grads_after_forward_backward(tmp_path, 8)  # 1 microbatch x 8
    assert tr1.batch_plan.num_microbatches == 1
    assert all(torch.equal(batch[k], batch1[k]) for k in batch)
    # Independent reference: plain PyTorch, float64, mean cross-entropy over the whole global batch.
    ref = copy.deepcopy(tr.model_parts[0]).double()
    ref.zero_grad(set_to_none=True)
    logits = ref(batch["input_ids"])["logits"]
    F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100).backward()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(g_accum[name].double(), p.grad, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(g_one[name], g_accum[name], rtol=1e-4, atol=1e-6)


def _fsdp(module, ctx, config):
    from plait.dist_core import fully_shard_module

    return fully_shard_module(module, ctx.mesh_for("dense"))  # reduce="mean": the loop makes it a sum


def _decay_after_each_step(trainer: Trainer) -> None:
    """A subscriber that changes the parameters after each optimizer step: the next forward must see it."""

    def decay(_event: AfterOptimizerStep) -> None:
        with torch.no_grad():
            for p in trainer.model_parts[0].parameters():
                p.mul_(0.9)

    trainer.subscribe(AfterOptimizerStep, decay)


def _dp_run(
    run_dir: str, steps: int, fsdp: bool = False, gather_once: bool = False, decay: bool = False
) -> list[float]:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from tests.loop._lm import load_reference_weights

    torch.set_num_threads(1)
    cfg = load_config(
        overrides=[
            f"--run.run_dir={run_dir}",
            f"--run.steps={steps}",
            "--mesh.data_shard=2",
            "--batching.global_batch_size=8",
            "--batching.microbatch_size=2",
            "--optimizer.lr=0.02",
            "--logging.progress_bar=false",
            f"--fsdp.gather_once_per_step={str(gather_once).lower()}",
            "--fsdp.prefetch_units=3",  # off by default
        ]
    )
    provider = ModuleProvider(
        TinyLM, parallelize_fn=_fsdp if fsdp else None, initial_weights=load_reference_weights
    )
    tr = Trainer(cfg, provider, DatasetProvider(_dataset()), CausalLMTask())
    # the config field reaches the executor: with it, the executor keeps the FSDP2 modules gathered over a step
    fsdp_modules = [m for m in tr.model_parts[0].modules() if isinstance(m, FSDPModule)]
    assert tr.executor.grad_sync.gathered == (fsdp_modules if gather_once else [])
    if decay:
        _decay_after_each_step(tr)
    losses = _losses(tr)
    tr.fit()
    tr.close()
    # resharded after every step (the optimizer updated the sharded parameters)
    assert not fsdp or all(isinstance(p, DTensor) for p in tr.model_parts[0].parameters())
    return losses


@pytest.mark.parametrize(
    ("fsdp", "gather_once", "decay"),
    [(False, False, False), (True, False, False), (True, True, False), (True, False, True)],
    ids=["plain", "fsdp2", "fsdp2-gather-once", "fsdp2-parameters-changed-after-each-step"],
)
def test_data_parallel_2_matches_one_process(tmp_path, fsdp, gather_once, decay):
    """FSDP2's first all-gathers of each step start at the end of the step before (``fsdp.prefetch_units``),
    after the AfterOptimizerStep subscribers: a subscriber's change to the parameters reaches the next step."""
    from tests.loop._lm import load_reference_weights

    steps = 6
    dp_losses = run_distributed(_dp_run, 2, str(tmp_path / "dp"), steps, fsdp, gather_once, decay)
    assert dp_losses[0] == dp_losses[1]
    single = Trainer(
        _config(tmp_path / "one", steps=steps),
        ModuleProvider(TinyLM, initial_weights=load_reference_weights),
        DatasetProvider(_dataset()),
        CausalLMTask(),
    )
    if decay:
        _decay_after_each_step(single)
    ref = _losses(single)
    single.fit()
    single.close()
    # Same global batches, same init: the token-weighted loss and updates agree up to summation order.
    assert dp_losses[0] == pytest.approx(ref, rel=1e-4)
    assert dp_losses[0][-1] < dp_losses[0][0]
    assert (tmp_path / "dp" / "metrics.jsonl").exists()


@pytest.mark.parametrize("optimizer", ["stochastic_adamw", "adamw"])
def test_clipping_matches_torch_clip_then_adamw(tmp_path, optimizer):
    """StochasticAdamW clips inside its step (the gradients stay unscaled), AdamW's gradients are
    clipped in place; both against torch's AdamW given gradients clipped by an independent norm."""
    torch.set_num_threads(1)
    cfg = _config(tmp_path, f"--optimizer.name={optimizer}", "--optimizer.weight_decay=0.0",
                  "--grad_clip.max_norm=0.05", steps=4)  # fmt: skip
    tr = _trainer(cfg)
    params = list(tr.model_parts[0].parameters())
    ref = [p.detach().clone() for p in params]
    group = tr.optimizers[0].param_groups[0]
    ref_opt = torch.optim.AdamW(ref, lr=group["lr"], betas=group["betas"], eps=group["eps"], weight_decay=0.0)
    scales, norms = [], []

    def before(e: BeforeOptimizerStep) -> None:
        grads = [p.grad.detach().clone() for p in params]
        norm = torch.linalg.vector_norm(torch.cat([g.double().flatten() for g in grads]))
        if e.grad_scale is None:  # clipped in place: the gradients' norm is now min(pre-clip norm, 0.05)
            assert float(norm) == pytest.approx(min(float(e.grad_norm), 0.05), rel=1e-5)
        else:  # unscaled gradients, the factor for the step
            torch.testing.assert_close(e.grad_norm.double(), norm)
            scale = min(1.0, 0.05 / (float(norm) + 1e-6))
            assert float(e.grad_scale) == pytest.approx(scale, rel=1e-6)
            grads = [g * scale for g in grads]
        scales.append(e.grad_scale)
        norms.append(float(e.grad_norm))
        for r, g in zip(ref, grads):
            r.grad = g
        ref_opt.param_groups[0]["lr"] = tr.optimizers[0].param_groups[0]["lr"]
        ref_opt.step()

    tr.subscribe(BeforeOptimizerStep, before)
    tr.fit()
    tr.close()
    assert (scales[0] is not None) == (optimizer == "stochastic_adamw")
    assert len(norms) == 4 and min(norms) > 0.05  # every step clipped
    for p, r in zip(params, ref):
        torch.testing.assert_close(p.detach(), r, atol=1e-6, rtol=1e-5)


class _ScalingSGD(torch.optim.SGD):
    """A user's optimizer that declares the in-step clipping capability: it scales the gradients it reads."""

    step_takes_grad_scale = True

    def __init__(self, params) -> None:
        super().__init__(params, lr=0.1)
        self.scales: list[float] = []

    @torch.no_grad()
    def step(self, closure=None, *, grad_scale=None):
        assert grad_scale is not None, "the trainer must pass the clipping factor to a declared optimizer"
        self.scales.append(float(grad_scale))
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        saved = [g.clone() for g in grads]
        torch._foreach_mul_(grads, grad_scale)
        super().step()
        for g, s in zip(grads, saved):
            g.copy_(s)


def test_in_step_clipping_is_an_optimizer_capability(tmp_path):
    """Any optimizer declaring ``step_takes_grad_scale`` gets the clipping factor in its step; the
    gradients it is handed are the unclipped ones (an SGD step against one computed by hand)."""
    torch.set_num_threads(1)
    cfg = _config(tmp_path, "--grad_clip.max_norm=0.05", steps=2)
    tr = _trainer(cfg, optimizer=lambda module, _: _ScalingSGD(module.parameters()))
    params = list(tr.model_parts[0].parameters())
    expected: list[torch.Tensor] = []

    def before(e: BeforeOptimizerStep) -> None:
        norm = torch.linalg.vector_norm(torch.stack([p.grad.double().norm() for p in params]))
        torch.testing.assert_close(e.grad_norm.double(), norm)  # not clipped in place
        scale = min(1.0, 0.05 / (float(norm) + 1e-6))
        lr = tr.optimizers[0].param_groups[0]["lr"]  # the schedule's
        expected[:] = [p.detach() - lr * scale * p.grad for p in params]

    tr.subscribe(BeforeOptimizerStep, before)
    tr.subscribe(
        AfterOptimizerStep,
        lambda e: [torch.testing.assert_close(p.detach(), x) for p, x in zip(params, expected)],
    )
    tr.fit()
    tr.close()
    assert len(tr.optimizers[0].scales) == 2 and max(tr.optimizers[0].scales) < 1.0


def test_events_and_post_optimizer_hook(tmp_path):
    provider_calls: list[tuple[list[torch.nn.Module], object]] = []
    provider = ModuleProvider(
        TinyLM, after_optimizer_step=lambda parts, ctx: provider_calls.append((parts, ctx))
    )
    tr = Trainer(_config(tmp_path, steps=2), provider, DatasetProvider(_dataset()), CausalLMTask())
    names: list[str] = []
    tr.subscribe(Event, lambda e: names.append(type(e).__name__))
    snapshots = []
    tr.subscribe(
        AfterOptimizerStep, lambda e: snapshots.append(tr.model_parts[0].head.weight.detach().clone())
    )
    tr.fit()
    tr.close()
    one_step = [
        "StepStart",
        "BeforeForwardBackward",
        *["AfterBackward"] * 4,
        "AfterForwardBackward",
        "BeforeOptimizerStep",
        "AfterOptimizerStep",
    ]
    assert names[0] == "TrainingStart" and names[-1] == "TrainingEnd"
    assert names[1:10] == one_step and names[10] == "MetricsLogged" and names[11] == "StepEnd"
    assert len(snapshots) == 2 and not torch.equal(snapshots[0], snapshots[1])
    # The provider's own update ran after each optimizer step, on the local stages.
    assert [(parts, ctx) for parts, ctx in provider_calls] == [(tr.model_parts, tr.ctx)] * 2


def test_events_carry_the_step_loss_lr_and_tokens(tmp_path):
    # lr_t = 0.02 / (t + 1) by torch's own LambdaLR; the loss by a float64 copy of the weights each step had
    cfg = _config(tmp_path, "--logging.interval=2", steps=3)
    tr = _trainer(
        cfg, lr_scheduler=lambda opts, c: torch.optim.lr_scheduler.LambdaLR(opts[0], lambda t: 1 / (t + 1))
    )
    batches = DatasetProvider(_dataset()).build_loader(cfg, tr.batch_plan, 0)  # the same batches, read again
    seen: dict[str, list] = {"fb": [], "opt": [], "end": [], "logged": [], "ref": []}

    def reference_loss(e) -> None:
        batch, model = next(batches), copy.deepcopy(tr.model_parts[0]).double()
        labels = batch["labels"]
        with torch.no_grad():
            logits = model(batch["input_ids"])["logits"]
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        seen["ref"].append((e.step, loss.item(), int((labels != -100).sum()), batch["input_ids"].numel()))

    tr.subscribe(StepStart, reference_loss)
    tr.subscribe(
        BeforeForwardBackward, lambda e: seen["fb"].append((e.step, e.num_microbatches, e.global_tokens))
    )
    tr.subscribe(AfterOptimizerStep, lambda e: seen["opt"].append((e.step, e.lr)))
    tr.subscribe(StepEnd, seen["end"].append)
    tr.subscribe(MetricsLogged, seen["logged"].append)
    tr.fit()
    tr.close()
    ref = seen["ref"]
    assert [r[0] for r in ref] == [0, 1, 2]
    assert seen["fb"] == [(t, 4, loss_tokens) for t, _, loss_tokens, _ in ref]
    assert seen["opt"] == [(t, pytest.approx(0.02 / (t + 1))) for t in range(3)]
    ends: list[StepEnd] = seen["end"]
    assert [e.step for e in ends] == [1, 2, 3] and not any(e.skipped for e in ends)
    for e, (t, loss, loss_tokens, _) in zip(ends, ref):
        assert e.metrics["loss"] == pytest.approx(loss, rel=1e-5)
        assert e.lr == pytest.approx(0.02 / (t + 1)) and e.loss_tokens == loss_tokens and e.seconds > 0
    assert [e.tokens_seen for e in ends] == [sum(r[3] for r in ref[: i + 1]) for i in range(3)]
    # logged at steps 2 and 3, each with its interval's tokens
    logged: list[MetricsLogged] = seen["logged"]
    assert [(m.step, m.interval.tokens if m.interval else None) for m in logged] == [
        (2, ref[0][3] + ref[1][3]), (3, ref[2][3])
    ]  # fmt: skip
    assert logged[-1].metrics["lr"] == pytest.approx(0.02 / 3)


def test_a_provider_without_the_post_step_method_fails_at_construction(tmp_path):
    class NoPostStep:
        """Every ModelProvider method but after_optimizer_step."""

        def __init__(self) -> None:
            self.inner = ModuleProvider(TinyLM)
            self.build_stage, self.parallelize = self.inner.build_stage, self.inner.parallelize
            self.materialize = self.inner.materialize
            self.load_initial_weights = self.inner.load_initial_weights
            self.flops_per_token = self.inner.flops_per_token

    with pytest.raises(AttributeError, match="after_optimizer_step"):
        Trainer(_config(tmp_path, steps=1), NoPostStep(), DatasetProvider(_dataset()), CausalLMTask())


class _NaNAt:
    """A task whose loss is NaN at one step (counting loss calls)."""

    def __init__(self, bad_step: int, microbatches: int = 4) -> None:
        self.inner = CausalLMTask()
        self.calls = 0
        self.bad_step, self.mbs = bad_step, microbatches

    def stage_inputs(self, batch, stage_index, num_stages):
        return self.inner.stage_inputs(batch, stage_index, num_stages)

    def num_loss_tokens(self, batch):
        return self.inner.num_loss_tokens(batch)

    def loss(self, outputs, batch):
        lo = self.inner.loss(outputs, batch)
        step = self.calls // self.mbs
        self.calls += 1
        if step == self.bad_step:
            return type(lo)(lo.objective * math.nan, lo.loss_sum * math.nan, lo.num_tokens)
        return lo


def test_nonfinite_loss_raises_naming_step_and_rank(tmp_path):
    tr = _trainer(_config(tmp_path, steps=3), task=_NaNAt(1))
    with pytest.raises(FloatingPointError, match="at step 1 on rank 0"):
        tr.fit()


def test_nonfinite_loss_skip_policy(tmp_path):
    tr = _trainer(_config(tmp_path, "--determinism.nonfinite_loss=skip", steps=3), task=_NaNAt(1))
    skipped: list[int] = []
    tr.subscribe(StepSkipped, lambda e: skipped.append(e.step))
    before: list[torch.Tensor] = []
    tr.subscribe(StepEnd, lambda e: before.append(tr.model_parts[0].head.weight.detach().clone()))
    tr.fit()
    assert skipped == [1] and tr.state.skipped_steps == 1 and tr.step == 3
    assert torch.equal(before[0], before[1])  # the skipped step changed nothing
    assert all(torch.isfinite(p).all() for p in tr.parameters())


def test_app_state_resumes_exactly(tmp_path):
    cfg = _config(tmp_path, steps=6)
    full = _trainer(cfg)
    ref = _losses(full)
    full.fit()

    first = _trainer(cfg)
    first.fit(steps=3)
    saved = {k: copy.deepcopy(v.state_dict()) for k, v in first.app_state().items()}
    assert saved["trainer"]["step"] == 3 and saved["data"]["batches_consumed"] == 3

    torch.manual_seed(1234)  # a different RNG/init to overwrite
    resumed = _trainer(cfg)
    for key, stateful in resumed.app_state().items():
        stateful.load_state_dict(saved[key])
    rest = _losses(resumed)
    resumed.fit()
    assert resumed.step == 6
    assert rest == ref[3:]  # bit-exact on CPU


def test_profiler_writes_a_trace(tmp_path):
    cfg = _config(
        tmp_path,
        "--profiling.enabled=true",
        "--profiling.wait=0",
        "--profiling.warmup=0",
        "--profiling.active=1",
        steps=2,
    )
    tr = _trainer(cfg)
    tr.fit()
    traces = list((tmp_path / "profile").glob("rank0_step*.json"))
    assert traces and json.loads(traces[0].read_text())["traceEvents"]


def _pp_run(run_dir: str, steps: int, schedule: str) -> tuple[list[float], bool]:
    import torch._functorch.config as functorch_config

    from tests.loop._lm import load_reference_weights, tiny_stage

    torch.set_num_threads(1)
    functorch_config.donated_buffer = True  # torch's default (pool workers are reused)
    cfg = load_config(
        overrides=[
            f"--run.run_dir={run_dir}",
            f"--run.steps={steps}",
            "--mesh.pipeline=2",
            f"--pipeline.kind={schedule}",
            *(["--pipeline.stages_per_rank=1"] if schedule == "zb1p" else []),
            "--batching.global_batch_size=8",
            "--batching.microbatch_size=2",
            "--optimizer.lr=0.02",
            "--logging.progress_bar=false",
        ]
    )
    provider = ModuleProvider(tiny_stage, stages=True, initial_weights=load_reference_weights)
    tr = Trainer(cfg, provider, DatasetProvider(_dataset()), CausalLMTask(), ctx=MeshContext(2, 1))
    losses = _losses(tr)
    tr.fit()
    tr.close()
    donated = functorch_config.donated_buffer
    functorch_config.donated_buffer = True
    return losses, donated


@pytest.mark.parametrize("schedule", ["1f1b", "zb1p"])
def test_pipeline_parallel_2_matches_one_process(tmp_path, schedule):
    from tests.loop._lm import load_reference_weights

    steps = 4
    results = run_distributed(_pp_run, 2, str(tmp_path / "pp"), steps, schedule)
    pp_losses = [r[0] for r in results]
    assert pp_losses[0] == pp_losses[1]
    # split backward keeps the graph between I and W: compiled backwards must not donate buffers
    assert [r[1] for r in results] == [schedule != "zb1p"] * 2
    cfg = _config(tmp_path / "one", steps=steps)
    single = Trainer(
        cfg,
        ModuleProvider(TinyLM, initial_weights=load_reference_weights),
        DatasetProvider(_dataset()),
        CausalLMTask(),
    )
    ref = _losses(single)
    single.fit()
    assert pp_losses[0] == pytest.approx(ref, rel=1e-4)


def test_too_many_skipped_steps_raise(tmp_path):
    cfg = _config(tmp_path, "--determinism.nonfinite_loss=skip", "--determinism.max_skipped_steps=0", steps=3)
    tr = _trainer(cfg, task=_NaNAt(0))
    with pytest.raises(
        FloatingPointError,
        match=r"1 steps skipped .* at step 0 on rank 0\), more than determinism\.max_skipped_steps=0",
    ):
        tr.fit()


class _SlowRows(torch.utils.data.Dataset):
    """The test rows, each taking 20 ms to read (a tokenizer that cannot keep up)."""

    def __init__(self) -> None:
        self.rows = _dataset()

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int):
        time.sleep(0.02)
        return self.rows[i]


def test_metrics_report_the_time_spent_waiting_for_data(tmp_path):
    # 8 rows per step at 20 ms each: the step loop waits >= 160 ms for a step that computes in a few ms.
    cfg = _config(tmp_path, "--logging.interval=2", steps=4)
    tr = Trainer(cfg, ModuleProvider(TinyLM), DatasetProvider(_SlowRows()), CausalLMTask())
    logged = tr.fit()
    tr.close()
    assert 0.5 < logged["data_wait_frac"] <= 1.0
