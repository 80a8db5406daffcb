"""``plait plan``: its model states (and every FSDP2 unit's gathered bytes) equal what real ranks build, its
valid layouts are those that build (with checkpointed layers: those that run a step), its best layout trains,
and a model that fits nowhere is refused with what would fit; its activations measured on one or two layers of each kind equal those of the whole model and what
a real forward saves, and a model far larger than the machine is planned from two layers of each kind;
``--calibrate`` measures the job on this device (a real ``plait train`` run, the optimizer's bytes as the
planner counts them; expert parallelism on P ranks) and the plan prices what it measures.

The references are real gloo ranks building the job's stages the way the trainer does (the stages of the
rank's pipeline coordinate, parallelised and materialised, the job's optimizer stepped once), never the
planner's own fake-group build; the activations' is a meta forward of the whole model.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import torch
from plait.dist_core import DeviceMeshParameters, DistributedContext
from plait.dist_core.testing import DistributedTestError, run_distributed
from plait.loop import BatchPlan, load_config
from plait.models import estimate_num_parameters
from plait.train.config import JobConfig
from plait.train.planner import Layout, Machine, Plan, PlanJob, main, plan
from plait.train.planner.memory import ActivationProfile, activation_profile, saved_bytes
from plait.train.train import DEFAULT_CONFIG
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from tests.e2e._pretrain_runner import REPO, run


def _config(*overrides: str) -> JobConfig:
    return load_config(DEFAULT_CONFIG, list(overrides), cls=JobConfig)


def _with_model(model: dict[str, Any], *overrides: str, **sections: Any) -> JobConfig:
    """The default job with another ``[model]`` and top-level keys or sections replaced."""
    data = _config(*overrides).model_dump(mode="json")
    return JobConfig.model_validate({**data, **sections, "model": model})


# Two dense layers, then MoE layers (sigmoid routing, a shared expert), and a multi-token-prediction module.
TINY_DEEPSEEK = dict(
    model_type="deepseek_v3", vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
    num_attention_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
    v_head_dim=16, moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
    n_group=2, topk_group=1, first_k_dense_replace=2, num_nextn_predict_layers=1,
)  # fmt: skip


def _layout(
    pp: int = 1, dpr: int = 1, dps: int = 1, cp: int = 1, tp: int = 1, ep: int = 1, sched: str | None = None
) -> Layout:
    spr = 2 if sched in ("zbv", "interleaved_1f1b", "dualpipev") else 1
    return Layout(pp, dpr, dps, cp, tp, ep, sched, spr, 2, "none")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _local_bytes(t: torch.Tensor) -> int:
    t = _local(t)
    return t.numel() * t.element_size()


def _fsdp_units(modules: list[torch.nn.Module], inner: bool = True) -> list[int]:
    """The bytes each FSDP2 unit (one per ``fully_shard`` call: modules sharded together share its state)
    of ``modules`` (and, with ``inner``, of their submodules) all-gathers, sorted."""
    states = {id(st): st for m in modules for sub in (m.modules() if inner else [m])
              if isinstance(sub, FSDPModule) for st in [sub._get_fsdp_state()]}  # fmt: skip
    return sorted(
        sum(
            math.prod(fp._orig_size) * fp.sharded_param.element_size()
            for fp in st._fsdp_param_group.fsdp_params
        )
        for st in states.values()
        if st._fsdp_param_group is not None
    )


def _built_states(config: dict[str, Any], layout: Layout) -> tuple[int, int, int, list[int], int, int]:
    """This rank's stages built by the trainer's own functions (their bytes of parameters, gradients and
    moments, the optimizer stepped once on zero gradients, what their FSDP2 units gather, the gradients
    outside the decoder layers, and what the units of the stages' roots and embeddings gather)."""
    from plait.loop.engine import build_stages, place_stages
    from plait.loop.optim.optimizers import build_optimizer
    from plait.loop.topology import Topology
    from plait.train.job import build_provider

    cfg = JobConfig.model_validate(config)
    ctx = DistributedContext.from_env(layout.mesh(), "cpu")
    topology = Topology.from_context(ctx)
    batch_plan = BatchPlan.from_sections(
        cfg.batching.model_copy(update={"microbatch_size": layout.microbatch_size}), layout.mesh()
    )
    schedule = batch_plan.schedule(layout.pipeline_options()) if layout.pp > 1 else None
    num_stages, indices = place_stages(schedule, topology)
    stages = build_stages(build_provider(cfg), cfg, ctx, topology, indices, num_stages, torch.device("cpu"))
    params = list({id(p): p for st in stages for p in st.parameters()}.values())
    outer = {id(p): p for st in stages for n, p in st.named_parameters() if ".layers." not in n}
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer = build_optimizer(cfg.optimizer, stages)
    optimizer.step()
    moments = sum(
        _local_bytes(v)
        for st in optimizer.state.values()
        for v in st.values()
        if isinstance(v, torch.Tensor) and v.dim()
    )
    return (
        sum(_local_bytes(p) for p in params),
        sum(_local_bytes(p.grad) for p in params if p.grad is not None),
        moments,
        _fsdp_units(stages),
        sum(_local_bytes(p.grad) for p in outer.values()),
        sum(
            _fsdp_units(
                [m for st in stages for m in (st, st.model.embed_tokens) if m is not None], inner=False
            )
        ),
    )


STATE_LAYOUTS = [
    _layout(dps=2),
    _layout(tp=2),
    _layout(dps=2, ep=2),
    _layout(cp=2),
    _layout(pp=2, sched="1f1b"),
    _layout(pp=2, sched="zbv"),
    _layout(dpr=2, dps=2, ep=2),
    _layout(pp=2, dps=2, sched="interleaved_1f1b"),
    _layout(dps=2, tp=2),
]


def _assert_states_are_the_ranks(cfg: JobConfig, layout: Layout) -> None:
    """The planner's states of every pipeline rank of ``layout`` (parameters, gradients, moments, each
    FSDP2 unit's gathered bytes, over which FSDP2's per-unit cost is counted, and the gradients outside the
    decoder layers, what a lone microbatch's peak holds, and the bytes of the units whose collectives no
    layer hides: the roots' and the embeddings') equal a real rank's build."""
    job = PlanJob(cfg)
    b = cfg.batching
    batch_plan = BatchPlan(b.global_batch_size, layout.microbatch_size, layout.dp, b.seq_len, layout.cp)
    _, num_stages, placement = job.schedule(batch_plan, layout)
    built = run_distributed(_built_states, layout.world, cfg.model_dump(mode="json"), layout)
    for p, (states, _) in enumerate(job.rank_states(layout, num_stages, placement)):
        rank = p * (layout.world // layout.pp)  # the rank of this pipeline coordinate with the others 0
        units = sorted(b for b in states.gathered if b)  # a root without parameters: 0 bytes, no FSDP2 group
        planned = (states.params, states.grads, states.optimizer, units, states.outer_grads, states.leading)
        assert planned == built[rank], (layout.name, p)


@pytest.mark.parametrize("layout", STATE_LAYOUTS, ids=lambda lay: lay.name)
@pytest.mark.parametrize("optimizer", ["adamw", "stochastic_adamw"])
def test_state_bytes_equal_what_the_ranks_build(layout: Layout, optimizer: str) -> None:
    _assert_states_are_the_ranks(_config(f"--optimizer.name={optimizer}"), layout)


@pytest.mark.parametrize(
    "layout",
    [_layout(dps=2), _layout(dps=2, ep=2), _layout(pp=2, dps=2, sched="1f1b")],
    ids=lambda lay: lay.name,
)
def test_units_of_several_layers_gather_what_the_ranks_build(layout: Layout) -> None:
    """``parallel.fsdp_layers_per_unit = 2`` (one ``fully_shard`` per two layers; DeepSeek-V3's dense and MoE
    layers built two of each kind): each unit gathers what the real ranks' unit does."""
    _assert_states_are_the_ranks(_with_model(TINY_DEEPSEEK, "--parallel.fsdp_layers_per_unit=2"), layout)


@pytest.mark.parametrize("units", [1, 2], ids=["one-layer-per-unit", "two-layers-per-unit"])
@pytest.mark.parametrize(
    "layout", [_layout(dps=2), _layout(pp=2, dps=2, sched="1f1b")], ids=lambda lay: lay.name
)
def test_row_sharded_embedding_is_no_unit_and_its_states_are_the_ranks(layout: Layout, units: int) -> None:
    """``parallel.shard_embedding_rows``: the table is sharded like FSDP2's and no unit gathers it (the
    units' bytes and what no layer hides, the root's alone, equal the real ranks'); also with two layers per
    unit, the scaling benchmark's dense setting."""
    overrides = ("--parallel.shard_embedding_rows=true", f"--parallel.fsdp_layers_per_unit={units}")
    _assert_states_are_the_ranks(_config(*overrides), layout)


@pytest.mark.parametrize(
    "layout", [_layout(dps=2, ep=2), _layout(tp=2), _layout(pp=2, sched="1f1b")], ids=lambda lay: lay.name
)
def test_state_bytes_of_layers_of_two_kinds_equal_what_the_ranks_build(layout: Layout) -> None:
    """The planner builds two layers of each kind (dense, MoE) of a 6-layer DeepSeek-V3 and counts the others
    as their kind's: the sums are those of the ranks' whole stages, byte for byte."""
    _assert_states_are_the_ranks(_with_model(TINY_DEEPSEEK), layout)


def _builds(config: dict[str, Any], layout: Layout) -> str:
    try:
        _built_states(config, layout)
    except (ValueError, NotImplementedError, RuntimeError, AssertionError) as e:
        return f"refused: {e}"
    return "built"


# Every mesh and pipeline schedule of 2 ranks.
CANDIDATES = [
    _layout(dps=2), _layout(dps=2, ep=2), _layout(cp=2), _layout(cp=2, ep=2), _layout(tp=2),
    *(_layout(pp=2, sched=s) for s in ("gpipe", "1f1b", "interleaved_1f1b", "zb1p", "zbv", "dualpipev")),
]  # fmt: skip


def _listed(cfg: JobConfig, mode: str) -> set[tuple[Any, ...]]:
    """The meshes and schedules ``plait plan`` lists for 2 GPUs, microbatches of 2 and ``mode`` checkpointing."""
    result = plan(cfg, 2, checkpointing=(mode,))
    assert result.unverified == 0
    return {_key(p.layout) for p in result.fits + result.too_big if p.layout.microbatch_size == 2}


def _key(layout: Layout) -> tuple[Any, ...]:
    return (layout.pp, layout.dp_shard, layout.cp, layout.tp, layout.ep, layout.schedule)


def test_the_valid_layouts_are_those_that_build() -> None:
    """Every candidate mesh and schedule on 2 ranks: the planner lists it exactly when real ranks build it."""
    cfg = _config("--batching.microbatch_size=2")
    listed = _listed(cfg, "none")
    for layout in CANDIDATES:
        outcome = run_distributed(_builds, 2, cfg.model_dump(mode="json"), layout)
        assert all(o == outcome[0] for o in outcome), outcome
        assert (outcome[0] == "built") == (_key(layout) in listed), (layout.name, outcome[0])


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["selective", "full"])
def test_the_listed_layouts_train_under_checkpointing(mode: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Every candidate on 2 ranks with checkpointed layers: the planner lists it exactly when ``plait train``
    runs a step of it (its backward included: eager selective checkpointing allows one backward per region,
    which the schedules that split a backward broke at their first step while the plan listed them)."""
    cfg = _config("--batching.microbatch_size=2")
    listed = _listed(cfg, mode)
    for layout in CANDIDATES:
        layout = dataclasses.replace(layout, checkpointing=mode)
        argv = ["--steps", "1", "--run-dir", str(tmp_path / layout.name), "--no-export", "--data.max_files=8",
                "--data.validation_files=1", "--checkpoint.enabled=false", "--evaluation.enabled=false",
                "--logging.progress_bar=false", *layout.overrides()]  # fmt: skip
        try:
            run_distributed(run, 2, argv, timeout=300)
            outcome = "ran"
        except DistributedTestError as e:
            outcome = f"failed: {e}"
        assert (outcome == "ran") == (_key(layout) in listed), (layout.name, outcome[-2000:])


def test_a_model_that_fits_nowhere_is_refused_with_what_would_fit(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--gpus", "1", "--gpu-memory", "0.01", "--checkpointing", "full"])
    assert exit_info.value.code == 1
    out = capsys.readouterr().out
    match = re.search(
        r"nothing fits in 0.01 GiB: the smallest layout needs ([\d.e-]+) GiB .*the smallest count that fits is (\d+) GPUs",
        out,
    )
    assert match, out
    assert float(match.group(1)) > 0.01 and int(match.group(2)) > 1


def test_explain_and_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    main(["--gpus", "2", "--checkpointing", "none", "--top", "2"])
    out = capsys.readouterr().out
    name = re.search(r"^\| 1 \| ([^|]+) \|", out, re.M)
    assert name, out
    main(["--gpus", "2", "--checkpointing", "none", "--explain", name.group(1).strip()])
    explained = capsys.readouterr().out
    for part in (
        "params",
        "grads",
        "optimizer",
        "activations",
        "compute_and_pipeline",
        "run it with: --mesh.pipeline=",
    ):
        assert part in explained, explained
    # A setting that rules out whole families of layouts is named under the table, whole: with its way out.
    graphs = ["--parallel.compile=true", "--parallel.cuda_graphs=true", "--model_dtype=bfloat16"]
    main(["--gpus", "2", "--checkpointing", "none", "--top", "1", *graphs])
    assert re.search(
        r"^refused most often \(\d+x\): ValueError: parallel\.cuda_graphs needs .*this layout has mesh\.\w+=2 "
        r"\(set parallel\.cuda_graphs=false for it\)$",
        capsys.readouterr().out,
        re.M,
    )
    with pytest.raises(SystemExit, match="unknown mode"):
        main(["--gpus", "2", "--checkpointing", "sometimes"])
    with pytest.raises(SystemExit, match="no valid layout named"):
        main(["--gpus", "2", "--checkpointing", "none", "--explain", "fsdp7"])
    for flag, value, rule in (("--gpus", "0", ">= 1"), ("--gpus-per-node", "0", ">= 1"), ("--top", "0", ">= 1"),
                              ("--gpu-memory", "-1", "> 0 GiB"), ("--gpu-memory", "nan", "> 0 GiB")):  # fmt: skip
        args = ["--gpus", "2", flag, value] if flag != "--gpus" else [flag, value]
        with pytest.raises(SystemExit, match=f"plait plan: error: {flag} must be {rule}, got"):
            main(args)


def test_a_fine_tuning_job_is_planned_from_its_checkpoint_config(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    """A fine-tuning config has no ``[model]``: ``plait plan --init-from HF_DIR`` takes the checkpoint's
    ``config.json`` (no weights needed), as ``plait train --init-from`` does. The planned parameters of one rank
    are those of transformers' own model built from that file; without ``--init-from``, or with a directory
    without ``config.json``, the error names what is missing."""
    import transformers
    from plait.train.job import adopt_checkpoint_config

    sft = REPO / "examples" / "sft" / "configs" / "full.toml"
    hf_config = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)  # fmt: skip
    hf_config.save_pretrained(tmp_path / "ckpt")
    main(["--config", str(sft), "--init-from", str(tmp_path / "ckpt"), "--gpus", "2", "--checkpointing", "none"])  # fmt: skip
    assert re.search(r"^plait plan: llama on 2 GPU\(s\).* \d+ layouts fit", capsys.readouterr().out, re.M)

    config = adopt_checkpoint_config(load_config(sft, [], cls=JobConfig), tmp_path / "ckpt", weights=False)
    job = PlanJob(config)
    states = job.rank_states(_layout(), 1, ((0,),))[0][0]
    with torch.device("meta"):
        reference = transformers.LlamaForCausalLM(hf_config)
    width = torch.empty((), dtype=getattr(torch, config.model_dtype)).element_size()
    assert states.params == sum(p.numel() for p in reference.parameters()) * width

    with pytest.raises(SystemExit, match=r"no \[model\] section .*--init-from HF_DIR"):
        main(["--config", str(sft), "--gpus", "2"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match=r"config\.json"):
        main(["--config", str(sft), "--init-from", str(tmp_path / "empty"), "--gpus", "2"])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_best_layout_trains(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The overrides ``plait plan`` prints for 2 GPUs run ``plait train`` on 2 CPU ranks."""
    plan_out = subprocess.run(
        [sys.executable, "-m", "plait", "plan", "--gpus", "2", "--checkpointing", "none", "--top", "3"],
        cwd=REPO, capture_output=True, text=True, timeout=300, check=True,
    ).stdout  # fmt: skip
    best = re.search(r"^best: (.*)$", plan_out, re.M)
    assert best, plan_out
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "-m", "plait", "train", "--steps", "2", "--run-dir", str(tmp_path / "run"), "--data.max_files=8",
        "--data.validation_files=1", "--evaluation.enabled=false", "--logging.progress_bar=false",
        "--checkpoint.enabled=false", "--no-export", *best.group(1).split(),
    ]  # fmt: skip
    run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=480,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert run.returncode == 0, (best.group(1), run.stdout[-3000:], run.stderr[-3000:])
    assert (tmp_path / "run" / "metrics.jsonl").exists()


def test_the_optimizer_calibration_moves_the_planned_state_bytes() -> None:
    """``optimizer_step`` (what ``--calibrate`` divides its time by) counts the bytes the planner's exact
    1-GPU states say the step moves: parameters and moments read and written, gradients read."""
    from plait.loop.optim import build_optimizer
    from plait.train.planner.timing import forward_backward_s, optimizer_step

    for name in ("adamw", "stochastic_adamw"):
        cfg = _config(f"--optimizer.name={name}", "--batching.seq_len=64")
        job = PlanJob(cfg)
        provider = job.provider()
        model = provider.build_stage(0, 1)
        provider.materialize(model, "cpu")
        forward_backward_s(model, 1, 64, torch.device("cpu"))  # the gradients
        _, moved = optimizer_step(build_optimizer(cfg.optimizer, model), torch.device("cpu"))
        ((states, _),) = job.rank_states(_layout(), 1, ((0,),))
        assert moved == 2 * states.params + states.grads + 2 * states.optimizer, name


@pytest.mark.timeout(300)
def test_calibration_measures_the_job_on_this_device() -> None:
    """``--calibrate`` on this CPU for two GPUs: the job run for two steps (a real ``plait train``), its model
    timed without and with full checkpointing, FSDP2 on a one-rank gloo group (a CPU's FSDP2 time is the
    host's: no GPU figure); every figure is a positive, finite
    measurement (their sizes are the GPU's business: on a shared CPU a few milliseconds are noise) and the
    plan prices them.
    A job that cannot run is an error naming the run's failure (``plait plan`` exits with it)."""
    from plait.train.planner import calibrated
    from plait.train.planner.timing import run_job

    cfg = _config("--batching.seq_len=128", "--batching.global_batch_size=4", "--batching.microbatch_size=2",
                  "--data.max_files=8", "--data.validation_files=1")  # fmt: skip
    machine = calibrated(PlanJob(cfg), Machine(fsdp_unit_gpu_s=1.0), modes=("full",), steps=2, gpus=2)
    assert 0 < machine.flops < float("inf") and 0 < machine.optimizer_bytes_per_s < float("inf")
    assert machine.fsdp_unit_s >= 0 and machine.fsdp_accumulate_s >= 0 and machine.step_s >= 0
    assert machine.fsdp_unit_gpu_s == machine.fsdp_accumulate_gpu_s == machine.fsdp_slack_bytes == 0
    # tensor and context parallelism over two gloo ranks: a host figure only
    for kind in ("tensor", "context"):
        assert dict(getattr(machine, f"{kind}_host_s"))["2"] >= 0
        assert dict(getattr(machine, f"{kind}_token_s")) == {"2": 0.0}
    assert [m for m, _ in machine.host_s] == ["none", "full"] and all(t >= 0 for _, t in machine.host_s)
    assert not machine.host_overlaps  # a CPU runs the ops as they are issued
    assert dict(machine.recompute)["none"] == 1 and 0 < dict(machine.recompute)["full"] < float("inf")
    # FSDP2's time per unit is priced on every unit of the rank (the step's last microbatch's and those
    # before it, a mean), the step's fixed cost on every step
    priced = dataclasses.replace(machine, fsdp_unit_s=0.01, fsdp_accumulate_s=0.004, step_s=0.5)
    fits = plan(cfg, 2, priced, checkpointing=("none",)).fits
    for fsdp in (p for p in fits if p.layout.dp_shard == 2):
        ((states, _),) = PlanJob(cfg).rank_states(fsdp.layout, 1, ((0,),))
        n = cfg.batching.global_batch_size // 2 // fsdp.layout.microbatch_size
        assert fsdp.time["fsdp_host_per_microbatch"] == pytest.approx(
            (0.01 + (n - 1) * 0.004) / n * states.units
        )
        if fsdp.layout.ep == 1:  # the units measured: each gathers its parameters whole, as these do
            assert machine.fsdp_unit_bytes == pytest.approx(sum(states.gathered) / states.units)
    assert fits[0].time["step_fixed"] == 0.5
    # the job's own host time per microbatch: on this CPU, which runs each op as issued, every microbatch's
    assert machine.microbatch_s >= 0
    plain = {p.layout: p.step_s for p in plan(cfg, 2, machine, checkpointing=("none",)).fits}
    slower = dataclasses.replace(machine, microbatch_s=machine.microbatch_s + 0.05)
    for p in plan(cfg, 2, slower, checkpointing=("none",)).fits:
        if p.layout.pp == 1:
            n = cfg.batching.global_batch_size // p.layout.dp // p.layout.microbatch_size
            assert p.step_s - plain[p.layout] == pytest.approx(0.05 * n), p.layout.name
    with pytest.raises(RuntimeError, match=r"plait train exited with 2: .*seq_len"):
        run_job(DEFAULT_CONFIG, 1, ["--batching.seq_len=0"], 2)
    missing = "--data.source=/nonexistent/corpus"  # the planner does not read the data; the run does
    with pytest.raises(SystemExit, match=r"--calibrate runs the job's model on one device .*data.source"):
        main(["--gpus", "1", "--calibrate", missing])


@pytest.mark.gpu
@pytest.mark.timeout(900)
def test_calibration_under_cuda_graphs_counts_the_activations_as_without_them() -> None:
    """A replayed CUDA graph's tensors sit in its pool, outside the allocator's count: the calibration of a
    job with graphs measures its activation figures as the same job's without them (read under the graphs,
    they were 0.00x of the count for the main job on an H200), and its host floor below theirs (what the
    graphs are for)."""
    from plait.train.planner import calibrated

    base = ("--batching.seq_len=256", "--batching.global_batch_size=8", "--batching.microbatch_size=4",
            "--parallel.compile=true", "--data.max_files=8", "--data.validation_files=1")  # fmt: skip
    graphs, plain = (
        calibrated(
            PlanJob(_config(*base, f"--parallel.cuda_graphs={on}")), Machine(), modes=("none",), steps=4
        )
        for on in ("true", "false")
    )
    for field in ("activation_scale", "backward_scale"):
        assert graphs.of_mode(field, "none") == pytest.approx(plain.of_mode(field, "none"), rel=0.1), field
    assert graphs.of_mode("host_s", "none") < plain.of_mode("host_s", "none")


def test_a_tensor_parallel_probe_that_fails_is_named_and_its_layouts_priced_at_the_bandwidth(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A model the job accepts tensor-parallel but whose probe fails (here a stand-in probe that raises)
    leaves its tensor-parallel figures unmeasured, with a warning naming the probe's error; the launch is run
    again with context parallelism alone, whose figures stand (against the plain model of their own launch),
    as do the calibration's others; each probe that ran logs its raw times (``plait.plan``, INFO)."""
    from plait.train import planner

    calls = []

    def probe(config: Path, ranks: int, *, expert_samples: int = 0, fsdp_samples: int = 0,
              tensor_samples: int = 0, context_samples: int = 0) -> dict[str, Any]:  # fmt: skip
        calls.append((ranks, expert_samples, fsdp_samples, tensor_samples, context_samples))
        if tensor_samples:
            raise RuntimeError(f"the {ranks}-rank probe exited with 1: boom")
        if context_samples:
            return {"ranks": ranks, "plain": {"1": 0.04, "2": 0.05}, "context": {"1": 0.1, "2": 0.12}}
        return {"ranks": ranks, "plain": {"1": 0.01, "2": 0.02}, "fsdp": {"1": 0.03, "2": 0.05},
                "fsdp_accumulating": {"1": 0.02, "2": 0.04}, "fsdp_units": 2}  # fmt: skip

    monkeypatch.setattr(planner, "probe_ranks", probe)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)  # as on the CPU: FSDP2 on one gloo rank
    caplog.set_level(logging.INFO, logger="plait.plan")
    with pytest.warns(UserWarning, match=r"tensor parallelism over 2 GPUs was not measured \(the 2-rank probe exited "
                      r"with 1: boom\): its layouts price its collectives' bytes at the bandwidth"):  # fmt: skip
        figures = planner._rank_figures(
            PlanJob(_config()), Machine(gpus_per_node=2), tmp_path / "job.json", 2
        )
    # every probe that ran logged its raw times
    logged = [json.loads(r.getMessage().split(": ", 1)[1]) for r in caplog.records if r.name == "plait.plan"]
    assert [run["ranks"] for run in logged] == [1, 2] and logged[1]["context"] == {"1": 0.1, "2": 0.12}
    # FSDP2, tensor and context parallelism at two microbatches in one (a CPU's microbatch: one sample)
    assert calls == [(1, 0, 2, 0, 0), (2, 0, 0, 2, 2), (2, 0, 0, 2, 0), (2, 0, 0, 0, 2)]
    assert figures["tensor_host_s"] == figures["tensor_token_s"] == ()
    layers = _config().model.num_hidden_layers  # type: ignore[union-attr]
    assert dict(figures["context_host_s"]) == pytest.approx({"2": 0.06 / layers})
    assert dict(figures["context_token_s"]) == {"2": 0.0}  # no GPU
    assert (figures["fsdp_unit_s"], figures["fsdp_accumulate_s"]) == pytest.approx((0.01, 0.005))


def test_host_figures_are_each_models_lowest_wall_time_against_the_plain_models() -> None:
    """A wall time bounds the host's floor from above at any sample count: each variant's host figure is its
    lowest time less the plain model's lowest, so one slow timing of one sample (here FSDP2's, as an H200
    lease measured a 0.9B MoE: 117.7 ms at one sample, 103.2 at the job's eight) moves no figure; the GPU
    figures stay the difference at two microbatches in one (16 samples)."""
    from plait.train.planner.timing import expert_parallel_s, fsdp_s, split_parallel_s

    times = {"ranks": 2, "fsdp_units": 15, "plain": {"1": 0.0397, "16": 0.0902},
             "fsdp": {"1": 0.1177, "8": 0.1032, "16": 0.1111},
             "fsdp_accumulating": {"1": 0.0900, "8": 0.0950, "16": 0.1050},
             "experts": {"1": 0.0700, "16": 0.1200}, "tensor": {"1": 0.0800, "16": 0.0600},
             "context": {"1": 0.0300, "16": 0.0500}}  # fmt: skip
    figures = fsdp_s(times, 16)
    assert figures["fsdp_unit_s"] == pytest.approx((0.1032 - 0.0397) / 15)  # the job's microbatch's
    assert figures["fsdp_accumulate_s"] == pytest.approx((0.0900 - 0.0397) / 15)  # one sample's
    assert figures["fsdp_unit_gpu_s"] == pytest.approx((0.1111 - 0.0902) / 15)
    assert figures["fsdp_accumulate_gpu_s"] == pytest.approx((0.1050 - 0.0902) / 15)
    assert expert_parallel_s(times, 16, 64, 4) == pytest.approx(
        ((0.0700 - 0.0397) / 4, (0.1200 - 0.0902) / (16 * 64) / 4)
    )
    # tensor parallelism: faster at 16 samples than at one, its floor is the 16 samples' time
    assert split_parallel_s(times, "tensor", 16, 64, 8) == pytest.approx(
        ((0.0600 - 0.0397) / 8, (0.0600 - 0.0902 / 2) / (16 * 64) / 8)
    )
    assert split_parallel_s(times, "context", 16, 64, 8)[0] == 0  # below the plain model's floor: none


def test_a_saved_machine_reads_back_as_the_same_figures(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``--save-machine`` writes what ``--machine`` reads: every figure, those by checkpointing mode too; a
    figure of the wrong type or range, or an unknown one, is an error naming it."""
    from plait.train.planner.timing import load_machine

    def figures(m: Machine) -> dict[str, Any]:
        return {k: dict(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(m).items()}

    measured = Machine(flops=123e12, host_s=(("none", 0.03), ("full", 0.05)), idle_s=(("none", 0.004),),
                       activation_scale=(("selective", 0.9),), backward_scale=(("none", 0.1), ("full", 0.4)),
                       allocator_slack=0.6, step_s=0.002, microbatch_s=0.004, fsdp_unit_s=0.001, fsdp_unit_gpu_s=0.003,
                       gpus_per_node=4, fsdp_accumulate_s=0.0004, fsdp_accumulate_gpu_s=0.0002, fsdp_slack_bytes=7e8,
                       fsdp_unit_bytes=8.5e7,
                       tensor_host_s=(("2", 0.0003),), tensor_token_s=(("2", 2e-9),),
                       context_host_s=(("2", 0.0001),), context_token_s=(("2", 3e-9),),
                       expert_host_s=(("all_gather:2", 0.002),), expert_token_s=(("all_gather:2", 1e-8),))  # fmt: skip
    path = tmp_path / "machine.json"
    path.write_text(measured.to_json())
    assert figures(load_machine(path, None)) == figures(measured)
    main(["--gpus", "1", "--checkpointing", "none", "--top", "1", "--machine", str(path),
          "--save-machine", str(tmp_path / "again.json")])  # fmt: skip
    assert figures(load_machine(tmp_path / "again.json", None)) == figures(
        dataclasses.replace(measured, gpus_per_node=1)
    )
    # a file from before the accumulating microbatches were measured prices them as the reducing one
    path.write_text(json.dumps({"fsdp_unit_s": 0.002, "fsdp_unit_gpu_s": 0.001}))
    older = load_machine(path, None)
    assert (older.fsdp_accumulate_s, older.fsdp_accumulate_gpu_s) == (0.002, 0.001)
    for bad, message in [
        ({"flops": 0}, "flops must be a number > 0, got 0"),
        ({"busbw": {"all_gather": "fast"}}, "busbw must be an object of names to numbers > 0"),
        ({"host_s": [0.1]}, "host_s must be an object of names to numbers >= 0"),
        (
            {"expert_token_s": {"all_gather:2": -1}},
            "expert_token_s must be an object of names to numbers >= 0",
        ),
        ({"gpus_per_node": 0}, "gpus_per_node must be an integer >= 1"),
        ({"fragmentation": 1.05}, r"unknown fields \['fragmentation'\]"),
        ([1], "a JSON object of Machine fields, got list"),
    ]:
        path.write_text(json.dumps(bad))
        with pytest.raises(SystemExit, match=rf"plait plan: error: --machine .*{message}"):
            main(["--gpus", "1", "--machine", str(path)])
    with pytest.raises(SystemExit, match=r"--save-machine .*No such file"):
        main(["--gpus", "1", "--checkpointing", "none", "--save-machine", str(tmp_path / "no" / "dir.json")])


def test_split_backward_schedules_need_compiled_layers_under_selective_checkpointing() -> None:
    """On 2 GPUs with selective checkpointing, the schedules that split a backward (zb1p, zbv, dualpipev) are
    refused for eager layers, with the job's reason (``JobConfig`` refuses them too), and listed for compiled
    ones; the other schedules are listed either way."""
    split = {"zb1p", "zbv", "dualpipev"}
    for compiled in (False, True):
        result = plan(_config(f"--parallel.compile={str(compiled).lower()}"), 2, checkpointing=("selective",))
        listed = {p.layout.schedule for p in result.fits + result.too_big if p.layout.pp == 2}
        assert listed >= {"gpipe", "1f1b"}
        assert (listed >= split) if compiled else not (listed & split), (compiled, listed)
        refusals = " ".join(result.refused)
        assert compiled or "with eager layers (parallel.compile=false) cannot run the zbv" in refusals, (
            refusals
        )


def test_compiled_layers_are_priced_with_their_backward_run_whole_at_the_input_pass() -> None:
    """A split-backward schedule cannot defer a compiled layer's weight gradients (its backward is one graph,
    run whole at the input pass: plait.pipelining.split_backward): priced so, zbv gains nothing over its
    eager pricing; the first pipeline rank's peak is reported beside the fullest rank's."""

    def zbv(compiled: bool) -> Any:
        fits = plan(_config(f"--parallel.compile={str(compiled).lower()}"), 2, checkpointing=("none",)).fits
        return {p.layout.name: p for p in fits if p.layout.schedule == "zbv"}

    eager, compiled = zbv(False), zbv(True)
    assert eager and eager.keys() == compiled.keys()
    for name, p in compiled.items():
        # a whole I and an empty W: no weight pass to fill the bubbles with
        assert p.step_s >= eager[name].step_s, name
        assert 0 < p.first_rank_peak_bytes <= p.peak_bytes
    assert any(p.step_s > eager[name].step_s for name, p in compiled.items())
    assert any(p.first_rank_peak_bytes < p.peak_bytes for p in compiled.values())  # V: rank 1 holds more
    flat = plan(_config(), 2, checkpointing=("none",)).fits
    assert all(p.first_rank_peak_bytes == p.peak_bytes for p in flat if p.layout.pp == 1)


def test_cuda_graphs_plan_fsdp_layouts_as_gathered_and_refuse_the_others() -> None:
    """Under CUDA graphs FSDP keeps every layer gathered (the plan of plait.models): the FSDP layouts are
    priced as without resharding after forward, those with pipeline, tensor or context ranks, or expert ranks
    with the all-to-all dispatch set, are refused by the plan; the dispatch unset is the all-gather one."""
    compiled = ("--parallel.compile=true", "--model_dtype=bfloat16")  # graphs need bf16 experts
    on = (*compiled, "--parallel.cuda_graphs=true")
    graphs = plan(_config(*on), 2, checkpointing=("none",))
    kept = plan(_config(*compiled, "--parallel.reshard_after_forward=false"), 2, checkpointing=("none",))
    resharded = plan(_config(*compiled), 2, checkpointing=("none",))

    def fsdp(p: Plan) -> dict[str, Any]:
        return {f.layout.name: f for f in p.fits if f.layout.dp_shard == 2 and f.layout.ep == 1}

    assert fsdp(graphs) and fsdp(graphs).keys() == fsdp(kept).keys()
    for name, p in fsdp(graphs).items():
        assert p.memory["gathered"] == fsdp(kept)[name].memory["gathered"], name
    assert any(p.memory["gathered"] > fsdp(resharded)[n].memory["gathered"] for n, p in fsdp(graphs).items())
    assert all(f.layout.pp == f.layout.tp == f.layout.cp == 1 for f in graphs.fits)
    assert any("parallel.cuda_graphs needs one stage per process" in why for why in graphs.refused)
    # the dispatch unset is the all-gather one under graphs (every size on the device): the expert layouts run
    gathered = plan(_config(*on, "--parallel.expert_dispatch=all_gather"), 2, checkpointing=("none",))
    for p in (graphs, gathered):
        assert any(f.layout.ep == 2 for f in p.fits)
    assert {f.layout.name: f.step_s for f in graphs.fits} == {f.layout.name: f.step_s for f in gathered.fits}
    # the all-to-all dispatch, set, reads its split sizes on the host: its expert layouts are refused
    to_all = plan(_config(*on, "--parallel.expert_dispatch=all_to_all"), 2, checkpointing=("none",))
    assert all(f.layout.ep == 1 for f in to_all.fits)
    assert any("parallel.expert_dispatch='all_gather'" in why for why in to_all.refused)


def test_equal_speeds_rank_the_larger_microbatch_first() -> None:
    """Without a host floor every microbatch size of a mode prices the same: the larger comes first."""
    fits = plan(_config(), 1, checkpointing=("none",)).fits
    sizes = [p.layout.microbatch_size for p in fits]
    assert len({round(p.tokens_per_s_per_gpu) for p in fits}) == 1 and sizes == sorted(sizes, reverse=True)
    floor = Machine(host_s=(("none", 1.0),))  # one second per microbatch: fewer, larger ones are faster
    first = plan(_config(), 1, floor, checkpointing=("none",)).fits[0]
    assert first.limit == "host" and first.layout.microbatch_size == max(sizes)


def test_the_layout_is_the_mesh_it_names() -> None:
    layout = _layout(pp=2, dps=2, tp=2, sched="1f1b")
    assert layout.world == 8 and layout.mesh() == DeviceMeshParameters(pipeline=2, data_shard=2, tensor=2)
    cfg = load_config(DEFAULT_CONFIG, layout.overrides(), cls=JobConfig)
    assert cfg.mesh == layout.mesh() and cfg.pipeline is not None and cfg.pipeline.kind == "1f1b"


def test_checkpointed_layers_keep_one_hidden_state_per_sample() -> None:
    """Full checkpointing keeps each layer's input, ``seq x hidden`` per sample; selective keeps more and
    no checkpointing more again."""
    cfg = _config()
    job, m = PlanJob(cfg), cfg.model
    per_layer = {
        ac: job.activation(Layout(1, 1, 1, 1, 1, 1, None, 1, 1, ac)).layers
        for ac in ("none", "selective", "full")
    }
    hidden_state = (
        cfg.batching.seq_len
        * m.hidden_size
        * torch.empty((), dtype=getattr(torch, cfg.model_dtype)).element_size()
    )
    assert all(layer == (hidden_state, 0) for layer in per_layer["full"]), per_layer["full"]
    for full, selective, none in zip(per_layer["full"], per_layer["selective"], per_layer["none"]):
        assert sum(full) < sum(selective) < sum(none)


def _whole_model_activations(job: PlanJob, mode: str) -> ActivationProfile:
    """The activation profile of one sample from meta forwards of the job's whole model (every layer)."""
    ac, m = job.config.parallel.activation_checkpointing, job.model

    def forward(checkpointing: str) -> Any:
        update = {"mode": checkpointing, "every": 1}
        provider = job.provider(compile=False, activation_checkpointing=ac.model_copy(update=update))
        model = provider.parallelize(provider.build_stage(0, 1), None)
        sac_ops = frozenset(ac.save_ops) if checkpointing == "none" else None
        return saved_bytes(model, job.config.batching.seq_len, m.hidden_size, sac_ops)

    return activation_profile(forward, mode, range(m.num_hidden_layers))


def _saved_by_a_real_forward(config: dict[str, Any], layout: Layout | None) -> dict[int, list[int]]:
    """Per decoder layer (-1 before them, -2 after), the bytes a forward of one sample of the job's model,
    built, parallelised as ``layout``'s rank does (None: one process) and materialised on this CPU, saves
    for its backward: ``[tensors whose last dim is the hidden size, the others]``."""
    cfg = JobConfig.model_validate(config)
    job = PlanJob(cfg)
    provider = job.provider(compile=False)
    ctx = DistributedContext.from_env(layout.mesh(), "cpu") if layout is not None else None
    model = provider.parallelize(provider.build_stage(0, 1), ctx)
    provider.materialize(model, torch.device("cpu"))
    saved: dict[int, list[int]] = defaultdict(lambda: [0, 0])
    storages: dict[int, torch.UntypedStorage] = {}
    where = [-1]
    for layer in model.decoder_layers():
        layer.register_forward_pre_hook(lambda m, a, i=layer.layer_idx: where.__setitem__(0, i))
        layer.register_forward_hook(lambda m, a, o: where.__setitem__(0, -2))

    def pack(t: torch.Tensor) -> torch.Tensor:
        # a saved weight, or a view of one (a transpose, a DTensor's local shard), holds no memory of its
        # own; the parameters are read now: FSDP2 swaps in the gathered ones around a unit's forward
        weights = {id(_local(p).untyped_storage()) for p in model.parameters()}
        if id(t.untyped_storage()) not in storages and id(t.untyped_storage()) not in weights:
            storages[id(t.untyped_storage())] = t.untyped_storage()
            saved[where[0]][0 if t.dim() and t.shape[-1] == job.model.hidden_size else 1] += t.nbytes
        return t

    torch.manual_seed(0)
    ids = torch.randint(0, 256, (1, cfg.batching.seq_len))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, labels=ids)
    return dict(saved)


def test_activations_equal_what_a_real_forward_saves() -> None:
    """The meta count (attention as the fused kernels save it) equals, byte for byte and per layer, what a
    forward of the materialised model saves on this CPU, where SDPA runs its flash kernel."""
    cfg = _config("--batching.seq_len=64")
    job = PlanJob(cfg)
    planned = job.activation(Layout(1, 1, 1, 1, 1, 1, None, 1, 1, "none"))
    saved = _saved_by_a_real_forward(cfg.model_dump(mode="json"), None)
    assert planned.layers == tuple(tuple(saved.get(i, [0, 0])) for i in range(job.model.num_hidden_layers))
    assert planned.ends == (tuple(saved.get(-1, [0, 0])), tuple(saved.get(-2, [0, 0])))


@pytest.mark.parametrize("factor", [None, 1.75], ids=["exact", "buffer_factor"])
def test_activations_of_the_all_gather_dispatch_equal_what_its_ranks_save(factor: float | None) -> None:
    """With expert parallelism by all-gather the experts' buffers hold every EP rank's tokens (or the
    buffer factor's share of them): the planner's activations of an EP=2 x FSDP=2 rank equal, per layer,
    what each of two real gloo ranks of that layout saves in a forward, and exceed one process's."""
    extra = [f"--parallel.expert_buffer_factor={factor}"] if factor else []
    cfg = _config("--batching.seq_len=64", "--parallel.expert_dispatch=all_gather", *extra)
    job = PlanJob(cfg)
    layout = _layout(dps=2, ep=2)
    planned = job.activation(layout)
    ranks = run_distributed(_saved_by_a_real_forward, 2, cfg.model_dump(mode="json"), layout)
    layers = range(job.model.num_hidden_layers)
    for saved in ranks:
        assert planned.layers == tuple(tuple(saved.get(i, [0, 0])) for i in layers)
    one_gpu = job.activation(_layout())
    assert all(sum(ep) > sum(one) for ep, one in zip(planned.layers, one_gpu.layers, strict=True))


@pytest.mark.parametrize(
    "model",
    [
        TINY_DEEPSEEK | {"mtp_loss_weight": 0.3},
        {**_config().model.model_dump(mode="json"), "num_hidden_layers": 6, "mlp_only_layers": [2]},  # type: ignore[union-attr]
    ],
    ids=["deepseek_v3-dense2-mtp", "qwen3_moe-dense-layer-2"],
)
def test_activations_of_the_layer_kinds_equal_the_whole_models(model: dict[str, Any]) -> None:
    """Measured on one or two layers of each kind and mapped onto the others, a sample's activations equal,
    byte for byte, those a forward of the whole model saves, under each checkpointing mode."""
    job = PlanJob(_with_model(model, "--batching.seq_len=64"))
    assert len(set(job.stand_in.values())) < job.model.num_hidden_layers
    for mode in ("none", "selective", "full"):
        planned = job.activation(Layout(1, 1, 1, 1, 1, 1, None, 1, 1, mode))
        assert planned == _whole_model_activations(job, mode), mode


def test_a_model_far_larger_than_the_machine_is_planned_from_two_layers_of_each_kind() -> None:
    """DeepSeek-V3 671B (its config's defaults: 61 layers, 256 experts) at 4096 tokens on 2 GPUs, from the
    config alone: every layout refused or priced, all too big; the two pipeline ranks of ``pp2`` hold the
    model's 671B parameters, byte for byte, although no stage was built with more than two layers of each
    kind (dense, MoE): what keeps the plan to seconds (whole stages took minutes)."""
    cfg = _with_model(
        {"model_type": "deepseek_v3"}, "--optimizer.name=stochastic_adamw", model_dtype="bfloat16",
        batching={"global_batch_size": 8, "microbatch_size": 1, "seq_len": 4096},
    )  # fmt: skip
    job = PlanJob(cfg)
    result = plan(cfg, 2, job=job)
    assert not result.fits and result.too_big and result.unverified == 0
    layout = _layout(pp=2, sched="1f1b")
    _, num_stages, placement = job.schedule(BatchPlan(8, layout.microbatch_size, 1, 4096), layout)
    ranks = job.rank_states(layout, num_stages, placement)
    assert sum(states.params for states, _ in ranks) == 2 * estimate_num_parameters(cfg.model)
    built = [len(list(stage.decoder_layers())) for stage, _ in job.prototypes.values()]
    assert built and max(built) <= 4, built


@pytest.mark.timeout(300)
def test_parallelisms_are_measured_on_their_ranks_and_priced(tmp_path: Path) -> None:
    """The probe ``--calibrate`` runs on P GPUs (here two gloo ranks of this CPU) times the model whole, with
    its experts sharded, tensor-parallel, context-parallel and under FSDP2 (as many units as the planner
    counts on the rank) and gives non-negative host and GPU figures; a probe that fails is an error naming
    it. Measured figures replace the collectives' bytes at the bandwidth: an EP2 (TP2, CP2) layout's step
    grows by the GPU figure times a rank's tokens, MoE layers (every layer; the DeepSeek's two dense layers
    pay no EP), microbatches and the mode's recompute factor when the GPU bounds it, by the host figure times
    those layers, microbatches and the mode's host floor over none's when the host does; an FSDP2 layout's by
    FSDP2's GPU figures times its units: the step's last microbatch's and the accumulating one's for each
    before it; an FSDP2 layout's allocator slack is at least the machine's FSDP2 floor; computed here from the
    layout."""
    from plait.train.planner.timing import expert_parallel_s, fsdp_s, probe_ranks, split_parallel_s

    cfg = _with_model(TINY_DEEPSEEK, "--batching.seq_len=32", "--parallel.expert_dispatch=all_gather")
    config = tmp_path / "job.json"
    config.write_text(json.dumps(cfg.model_dump(mode="json")))
    times = probe_ranks(config, 2, expert_samples=2, fsdp_samples=2, tensor_samples=2, context_samples=2)
    for host, per_token in (expert_parallel_s(times, 2, 32, 4), split_parallel_s(times, "tensor", 2, 32, 6),
                            split_parallel_s(times, "context", 2, 32, 6)):  # fmt: skip
        assert 0 <= host < 60 and 0 <= per_token < 1
    figures = fsdp_s(times, 2)
    assert figures.keys() == {"fsdp_unit_s", "fsdp_unit_gpu_s", "fsdp_accumulate_s", "fsdp_accumulate_gpu_s",
                              "fsdp_slack_bytes"} and all(0 <= f < 60 for f in figures.values())  # fmt: skip
    assert figures["fsdp_slack_bytes"] == 0  # no GPU, no allocator to read
    fsdp2 = Layout(1, 1, 2, 1, 1, 1, None, 1, 2, "none")
    ((states, _),) = PlanJob(cfg).rank_states(fsdp2, 1, ((0,),))
    assert times["fsdp_units"] == states.units > cfg.model.num_hidden_layers  # type: ignore[union-attr]
    bad = tmp_path / "bad.json"
    bad.write_text(
        json.dumps(_with_model(TINY_DEEPSEEK | {"n_routed_experts": 3, "n_group": 1}).model_dump(mode="json"))
    )
    with pytest.raises(
        RuntimeError, match=r"the 2-rank probe exited with 1: .*num_experts \(3\) is not divisible"
    ):
        probe_ranks(bad, 2, expert_samples=2)

    fast = dict(busbw=tuple((k, 1e30) for k, _ in Machine().busbw), latency_s=0.0)  # no FSDP time to hide
    host_bound = dict(flops=1e30, host_s=(("none", 0.01), ("full", 0.025)))
    moe_layers = cfg.model.num_hidden_layers - 2  # type: ignore[union-attr]
    # expert parallelism on the MoE layers (the DeepSeek's two dense layers pay nothing), tensor parallelism on
    # every layer; the unmeasured TP is priced at an infinite bandwidth: no time
    all_layers = cfg.model.num_hidden_layers  # type: ignore[union-attr]
    for kind, key, layers in [("expert", "all_gather:2", moe_layers), ("tensor", "2", all_layers),
                              ("context", "2", all_layers)]:  # fmt: skip
        for bound, figures, machine in [
            ("gpu", (0.0, 3e-7), fast),
            ("host", (0.004, 0.0), fast | host_bound),
        ]:
            zero, measured = (
                Machine(**machine, **{f"{kind}_host_s": ((key, f * figures[0]),),  # type: ignore[arg-type]
                                      f"{kind}_token_s": ((key, f * figures[1]),)})
                for f in (0, 1)
            )  # fmt: skip
            for mode in ("none", "full"):
                layout = {"expert": Layout(1, 1, 2, 1, 1, 2, None, 1, 2, mode),
                          "tensor": Layout(1, 1, 1, 1, 2, 1, None, 1, 2, mode),
                          "context": Layout(1, 1, 1, 2, 1, 1, None, 1, 2, mode)}[kind]  # fmt: skip
                before, after = (
                    next(p for p in plan(cfg, 2, m, checkpointing=(mode,)).fits if p.layout == layout)
                    for m in (zero if kind == "expert" else Machine(**machine), measured)
                )
                microbatches = cfg.batching.global_batch_size // layout.dp // layout.microbatch_size
                if bound == "gpu":
                    tokens = layout.microbatch_size * cfg.batching.seq_len // layout.cp  # a rank's
                    each = figures[1] * tokens * Machine().of_mode("recompute", mode)
                else:
                    each = figures[0] * dict(host_bound["host_s"])[mode] / 0.01  # type: ignore[arg-type]
                assert after.step_s - before.step_s == pytest.approx(each * layers * microbatches), (
                    kind, bound, mode,
                )  # fmt: skip
    microbatches = cfg.batching.global_batch_size // 2 // fsdp2.microbatch_size
    assert microbatches > 1
    gpu = dict(fsdp_unit_gpu_s=0.002, fsdp_accumulate_gpu_s=0.0005)
    slack = dict(fsdp_slack_bytes=3 * 2**30)
    before, after, floor = (
        {p.layout: p for p in plan(cfg, 2, m, checkpointing=("none",)).fits}
        for m in (Machine(**fast), Machine(**fast, **gpu), Machine(**fast, **slack))  # type: ignore[arg-type]
    )
    # the step's last microbatch reduces (0.002 per unit), those before it accumulate (0.0005)
    each = 0.002 + (microbatches - 1) * 0.0005
    assert after[fsdp2].step_s - before[fsdp2].step_s == pytest.approx(each * states.units)
    # measured on units of another size, the GPU's figure scales by a layout's units' mean gathered bytes:
    # expert parallelism keeps the experts out of FSDP2's gathers
    mean = sum(states.gathered) / states.units
    ep2 = Layout(1, 1, 2, 1, 1, 2, None, 1, 2, "none")
    ((ep_states, _),) = PlanJob(cfg).rank_states(ep2, 1, ((0,),))
    # against the model's own parameters: FSDP2's units gather all of them, under EP all but the experts
    from plait.train.job import build_provider

    sizes = {
        n: p.numel() * p.element_size() for n, p in build_provider(cfg).build_stage(0, 1).named_parameters()
    }
    assert sum(states.gathered) == sum(sizes.values())
    assert sum(ep_states.gathered) == sum(b for n, b in sizes.items() if ".experts." not in n)
    ratio = sum(ep_states.gathered) / ep_states.units / mean
    assert ratio < 0.5
    for unit_bytes, fsdp2_scale, ep2_scale in [(mean, 1.0, ratio), (mean / 2, 2.0, 2 * ratio)]:
        sized = Machine(**fast, **gpu, fsdp_unit_bytes=unit_bytes)  # type: ignore[arg-type]
        got = {p.layout: p for p in plan(cfg, 2, sized, checkpointing=("none",)).fits}
        for layout, scale, st in ((fsdp2, fsdp2_scale, states), (ep2, ep2_scale, ep_states)):
            assert got[layout].step_s - before[layout].step_s == pytest.approx(each * st.units * scale)
    # the allocator's slack under FSDP2 is at least the machine's floor; without FSDP2 it is not
    assert floor[fsdp2].memory["allocator_slack"] == 3 * 2**30
    assert all(p.memory["allocator_slack"] == before[p.layout].memory["allocator_slack"]
               for p in floor.values() if p.layout.dp_shard * p.layout.cp == 1)  # fmt: skip
