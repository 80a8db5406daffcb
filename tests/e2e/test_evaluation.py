"""The main job's validation loss, distributed over every parallel layout on gloo, equals a single-process
evaluation of the same weights (the seed checkpoint, loaded with Hugging Face-format IO) on the same
held-out batches (the corpus's last files, in order), computed here in float64 from the logits."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from plait.dist_core.testing import run_distributed
from plait.train.train import parse_args

from tests.e2e._pretrain_runner import FAST, dataset, evaluate, run

GLOBAL_BATCH, EVAL_STEPS = 8, 2
EVAL = ["--evaluation.enabled=true", f"--evaluation.steps={EVAL_STEPS}", "--checkpoint.enabled=false"]
BATCH = [f"--batching.global_batch_size={GLOBAL_BATCH}"]


@pytest.fixture(scope="module")
def seed_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("seed_eval") / "hf"
    run(["--write-seed-checkpoint", str(path)])
    return path


def _reference(seed: Path) -> float:
    """Token-weighted cross-entropy of the first EVAL_STEPS global batches of the held-out files."""
    from plait.models import from_pretrained

    config, _ = parse_args([*FAST, *BATCH])
    data = dataset(config.data, config.batching.seq_len, "validation")
    model = from_pretrained(seed, dtype=torch.float32).eval()
    loss_sum, tokens = 0.0, 0
    with torch.no_grad():
        for i in range(EVAL_STEPS * GLOBAL_BATCH):
            s = data[i]
            logits = model(
                input_ids=s["input_ids"][None],
                position_ids=s["position_ids"][None],
                document_ids=s["document_ids"][None],
            )["logits"][0]
            labels = s["labels"]
            loss_sum += F.cross_entropy(logits.double(), labels, ignore_index=-100, reduction="sum").item()
            tokens += int((labels != -100).sum())
    return loss_sum / tokens


LAYOUTS = {  # name: (world size, arguments)
    "1proc": (1, ["--batching.microbatch_size=4"]),
    "dp2": (2, ["--batching.microbatch_size=4", "--mesh.data_replicate=2"]),
    "fsdp2": (2, ["--batching.microbatch_size=2", "--mesh.data_shard=2"]),
    "ep2": (2, ["--batching.microbatch_size=4", "--mesh.data_shard=2", "--mesh.expert=2"]),
    "pp2_1f1b": (2, ["--batching.microbatch_size=4", "--mesh.pipeline=2", "--pipeline.kind=1f1b"]),
    "pp2_zbv": (2, ["--batching.microbatch_size=2", "--mesh.pipeline=2", "--pipeline.kind=zbv"]),
}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_validation_loss_matches_single_process(seed_checkpoint: Path, tmp_path: Path) -> None:
    want = _reference(seed_checkpoint)
    for layout, (world, extra) in LAYOUTS.items():
        argv = [
            *FAST,
            *BATCH,
            *EVAL,
            "--init-from",
            str(seed_checkpoint),
            "--run-dir",
            str(tmp_path / layout),
        ]
        argv += extra
        results = [evaluate(argv)] if world == 1 else run_distributed(evaluate, world, argv, timeout=200)
        for rank, got in enumerate(results):
            assert got["val_loss"] == pytest.approx(want, rel=1e-5), f"{layout} rank {rank}: {got} vs {want}"
            assert got["val_ppl"] == pytest.approx(math.exp(got["val_loss"]), rel=1e-12)
