"""End-to-end CPU tests of the main job, ``plait train``.

1. A newcomer's run (the ``plait`` command in a subprocess, checkpointing and HF export on) finishes,
   logs finite metrics, writes a checkpoint and an HF export that transformers loads with the same
   logits as plait; ``plait export`` of the run's checkpoint writes the same weights.
2. From one seed checkpoint, the 10-step loss curve agrees across parallel layouts on gloo
   (1 process, DP=2, FSDP=2, EP=2, PP=2 1F1B, PP=2 ZBV, PP=2 x DP=2, CP=2 all-gather and ring,
   FSDP=2 x CP=2, PP=2 x CP=2).
3. A run resumed from a mid-run checkpoint continues the same curve, bit for bit.

Multi-rank runs call ``plait.train.train.main`` on the warm rank pool of ``plait.dist_core.testing``.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from plait.dist_core.testing import run_distributed

from tests.e2e._pretrain_runner import FAST, REPO, losses, read_metrics, run

PLAIT = str(Path(sys.executable).parent / "plait")  # the console script, as a user runs it

STEPS = 10
# Per-step loss tolerance between layouts (fp32 on CPU). In practice the curves are bit-identical:
# the layouts compute the same sums in the same order up to collective reductions of 2 addends.
LOSS_RTOL = 1e-4
LOSS_ATOL = 0.0
# HF export vs plait logits, fp32.
LOGITS_ATOL = 1e-4

# global batch 8, microbatch 4 (2 microbatches per step; ZBV needs >= pp = 2 microbatches).
BATCH = ["--batching.global_batch_size=8", "--batching.microbatch_size=4"]
NO_CKPT = ["--checkpoint.enabled=false", "--no-export"]


def _argv(run_dir: Path, *extra: str, steps: int = STEPS) -> list[str]:
    return ["--steps", str(steps), "--run-dir", str(run_dir), *BATCH, *FAST, *extra]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_main_job_runs_checkpoints_and_exports(tmp_path: Path) -> None:
    """The newcomer's command, for 3 steps with checkpointing and the HF export; then ``plait export``
    of the same step."""
    run_dir = tmp_path / "run"
    cmd = [PLAIT, "train", "--steps", "3", "--run-dir", str(run_dir), *BATCH, *FAST]
    cmd += ["--checkpoint.enabled=true", "--checkpoint.interval=3"]
    env = {k: v for k, v in os.environ.items() if k not in {"RANK", "WORLD_SIZE", "LOCAL_RANK"}}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, (
        f"plait train exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    )

    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        for key in ("loss", "lr", "grad_norm", "tokens_per_s"):
            assert key in r and math.isfinite(float(r[key])), (key, r)
        assert r["loss"] > 0 and r["tokens_per_s"] > 0

    ckpt = run_dir / "checkpoints" / "step_00000003"
    assert (ckpt / "plait_checkpoint.json").is_file(), sorted(
        p.name for p in (run_dir / "checkpoints").iterdir()
    )

    hf_dir = run_dir / "hf"
    assert (hf_dir / "config.json").is_file()
    from plait.models import from_pretrained
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    ours = from_pretrained(hf_dir, dtype=torch.float32).eval()
    ids = torch.tensor([list(b"def main():\n    return 0\n  "), list(b"import sys; print(sys.argv)")])
    with torch.no_grad():
        ref = hf(ids).logits
        out = ours(input_ids=ids)["logits"]
    assert ref.shape == (*ids.shape, hf.config.vocab_size)
    from plait.loop.data import ByteTokenizer

    assert hf.config.eos_token_id == ByteTokenizer().eos_id  # generation stops at the end of a document
    torch.testing.assert_close(out.float(), ref.float(), atol=LOGITS_ATOL, rtol=0)

    exported = tmp_path / "exported"
    proc = subprocess.run(
        [PLAIT, "export", str(run_dir), "--to", str(exported)], env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    again = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, ref, atol=0, rtol=0)


@pytest.fixture(scope="module")
def seed_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("seed") / "hf"
    run(["--write-seed-checkpoint", str(path)])
    assert (path / "config.json").is_file()
    return path


def _single_process_curve(seed: Path, run_dir: Path, *extra: str) -> dict[int, float]:
    run(_argv(run_dir, "--init-from", str(seed), *NO_CKPT, *extra))
    curve = losses(run_dir)
    assert sorted(curve) == list(range(1, STEPS + 1))
    assert all(math.isfinite(v) for v in curve.values())
    assert curve[STEPS] < curve[1] - 0.5, f"loss should fall over {STEPS} steps: {curve}"
    return curve


@pytest.fixture(scope="module")
def reference_curves(
    seed_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[int, dict[int, float]]:
    """1-process loss curves from the seed checkpoint (in this process), by microbatch size.

    The microbatch size is part of the objective (the MoE balancing loss is computed per microbatch),
    so each layout is compared with the 1-process run of the same global batch and microbatch size."""
    return {
        mb: _single_process_curve(
            seed_checkpoint,
            tmp_path_factory.mktemp(f"single_mb{mb}") / "run",
            f"--batching.microbatch_size={mb}",
        )
        for mb in (4, 2)
    }


LAYOUTS = {  # name: (world size, microbatch size, mesh arguments)
    "dp2": (2, 4, ["--mesh.data_replicate=2"]),
    "fsdp2": (2, 4, ["--mesh.data_shard=2"]),
    "ep2": (2, 4, ["--mesh.data_shard=2", "--mesh.expert=2"]),
    "ep2_all_gather": (
        2,
        4,
        ["--mesh.data_shard=2", "--mesh.expert=2", "--parallel.expert_dispatch=all_gather"],
    ),
    "pp2_1f1b": (2, 4, ["--mesh.pipeline=2", "--pipeline.kind=1f1b"]),
    "pp2_zbv": (2, 4, ["--mesh.pipeline=2", "--pipeline.kind=zbv"]),
    # 4 ranks: microbatch 2 so that 8 = 2 x dp 2 x 2 microbatches per rank (>= pp for the schedule).
    "pp2_dp2": (4, 2, ["--mesh.pipeline=2", "--mesh.data_shard=2", "--pipeline.kind=1f1b"]),
    # split backward over per-layer FSDP2 (its weight gradients need the parameters the forward used)
    "pp2_dp2_zbv": (4, 2, ["--mesh.pipeline=2", "--mesh.data_shard=2", "--pipeline.kind=zbv"]),
    # each FSDP2 module all-gathered once per step (2 microbatches per rank)
    "fsdp2_gather_once": (2, 2, ["--mesh.data_shard=2", "--fsdp.gather_once_per_step=true"]),
    # Context parallelism: every sequence split over 2 ranks (load-balanced layout).
    "cp2_allgather": (2, 4, ["--mesh.context_shard=2"]),
    "cp2_ring": (2, 4, ["--mesh.context_shard=2", "--parallel.context_parallel_attention=ring"]),
    "fsdp2_cp2": (4, 4, ["--mesh.data_shard=2", "--mesh.context_shard=2"]),
    "pp2_cp2": (4, 4, ["--mesh.pipeline=2", "--mesh.context_shard=2", "--pipeline.kind=1f1b"]),
}


def test_single_process_curves(reference_curves: dict[int, dict[int, float]]) -> None:
    """The references themselves: 10 finite, falling losses each (the layouts compare against them)."""
    assert all(len(curve) == STEPS for curve in reference_curves.values())


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layouts_agree_from_seed_checkpoint(
    layout: str, seed_checkpoint: Path, reference_curves: dict[int, dict[int, float]], tmp_path: Path
) -> None:
    world_size, microbatch, mesh_args = LAYOUTS[layout]
    reference_curve = reference_curves[microbatch]
    run_dir = tmp_path / layout
    mb = f"--batching.microbatch_size={microbatch}"
    argv = _argv(run_dir, "--init-from", str(seed_checkpoint), *NO_CKPT, mb, *mesh_args)
    run_distributed(run, world_size, argv, timeout=200)
    curve = losses(run_dir)
    assert sorted(curve) == sorted(reference_curve), f"{layout}: logged steps {sorted(curve)}"
    got = torch.tensor([curve[s] for s in sorted(curve)], dtype=torch.float64)
    want = torch.tensor([reference_curve[s] for s in sorted(reference_curve)], dtype=torch.float64)
    torch.testing.assert_close(
        got, want, rtol=LOSS_RTOL, atol=LOSS_ATOL, msg=lambda m: f"{layout} vs 1 process:\n{m}\n{got}\n{want}"
    )


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_resume_continues_the_curve(seed_checkpoint: Path, tmp_path: Path) -> None:
    """Crash after step 5's checkpoint (drop step 10's and the metrics), rerun: steps 6..10 match exactly."""
    run_dir = tmp_path / "run"
    ckpt_args = [
        "--checkpoint.enabled=true",
        "--checkpoint.interval=5",
        "--checkpoint.keep_last=5",
        "--checkpoint.async_mode=thread",
        "--no-export",
    ]
    argv = _argv(run_dir, "--init-from", str(seed_checkpoint), *ckpt_args)
    run(argv)
    first = losses(run_dir)
    assert sorted(first) == list(range(1, STEPS + 1))
    ckpts = run_dir / "checkpoints"
    assert (ckpts / "step_00000005" / "plait_checkpoint.json").is_file()
    assert (ckpts / "step_00000010").is_dir()

    shutil.rmtree(ckpts / "step_00000010")
    (run_dir / "metrics.jsonl").unlink()
    run(argv)
    second = losses(run_dir)
    assert sorted(second) == list(range(6, STEPS + 1)), (
        f"expected a resume from step 5, logged {sorted(second)}"
    )
    for step in range(6, STEPS + 1):
        assert second[step] == first[step], (
            f"step {step}: resumed {second[step]!r} != first run {first[step]!r}"
        )


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout", ["fsdp2", "pp2_1f1b"])
def test_resume_on_another_layout_continues_the_curve(
    layout: str, seed_checkpoint: Path, reference_curves: dict[int, dict[int, float]], tmp_path: Path
) -> None:
    """A 1-process checkpoint at step 5 resumed on 2 ranks (each pipeline stage loads its part of the
    model and optimizer state): steps 6..10 follow the 1-process curve."""
    run_dir = tmp_path / "run"
    ckpt_args = [
        "--checkpoint.enabled=true",
        "--checkpoint.interval=5",
        "--checkpoint.async_mode=off",
        "--no-export",
    ]
    run(_argv(run_dir, "--init-from", str(seed_checkpoint), *ckpt_args))  # the LR schedule spans 10 steps
    shutil.rmtree(run_dir / "checkpoints" / "step_00000010")
    (run_dir / "metrics.jsonl").unlink()
    world_size, microbatch, mesh_args = LAYOUTS[layout]
    assert microbatch == 4  # the 1-process run's (BATCH)
    run_distributed(run, world_size, _argv(run_dir, *ckpt_args, *mesh_args), timeout=200)
    resumed, want = losses(run_dir), reference_curves[4]
    assert sorted(resumed) == list(range(6, STEPS + 1)), (
        f"expected a resume from step 5, logged {sorted(resumed)}"
    )
    got = torch.tensor([resumed[s] for s in sorted(resumed)], dtype=torch.float64)
    torch.testing.assert_close(got, torch.tensor([want[s] for s in sorted(resumed)], dtype=torch.float64),
                               rtol=LOSS_RTOL, atol=LOSS_ATOL)  # fmt: skip
