"""Checkpointing wired into the Trainer: periodic async saves, resume on construction, exact curve."""

from __future__ import annotations

from typing import Any

import torch
from plait.dist_core.testing import run_distributed
from plait.loop import (
    CausalLMTask,
    DatasetProvider,
    ModuleProvider,
    StepEnd,
    Trainer,
    load_config,
    pack_documents,
)

from tests.loop._lm import VOCAB, TinyLM, pattern_tokens


def _trainer(
    run_dir, steps: int, dp: int = 1, mode: str = "thread", overrides: tuple[str, ...] = (), **hooks: Any
) -> Trainer:
    cfg = load_config(
        overrides=[
            f"--run.run_dir={run_dir}",
            f"--run.steps={steps}",
            f"--mesh.data_shard={dp}",
            "--batching.global_batch_size=8",
            "--batching.microbatch_size=2",
            "--batching.seq_len=16",
            "--optimizer.lr=0.02",
            "--logging.progress_bar=false",
            "--checkpoint.enabled=true",
            "--checkpoint.interval=3",
            f"--checkpoint.async_mode={mode}",
            *overrides,
        ]
    )
    data = DatasetProvider(pack_documents(pattern_tokens(), 16, eos_id=VOCAB - 1))
    return Trainer(cfg, ModuleProvider(TinyLM), data, CausalLMTask(), **hooks)


def _fit(trainer: Trainer, steps: int | None = None) -> list[float]:
    losses: list[float] = []
    trainer.subscribe(StepEnd, lambda e: losses.append(e.metrics["loss"]))
    trainer.fit(steps)
    trainer.close()
    return losses


def _interrupted_and_resumed(run_dir: str, dp: int) -> tuple[list[float], list[float], int]:
    torch.set_num_threads(1)
    reference = _fit(_trainer(f"{run_dir}/full", 8, dp))
    first = _fit(_trainer(f"{run_dir}/cut", 8, dp), steps=4)  # "crash" after step 4: last save was 3
    resumed_trainer = _trainer(f"{run_dir}/cut", 8, dp)
    resumed_trainer.resume()  # fit() would; here the resumed step is looked at first
    start = resumed_trainer.step
    return reference, first + _fit(resumed_trainer), start


def test_resume_continues_the_curve_bit_for_bit(tmp_path):
    reference, cut, start = _interrupted_and_resumed(str(tmp_path), dp=1)
    # fit(steps=4) ends with a final save at step 4, which the new trainer resumes from.
    assert start == 4
    assert cut == reference


def _dp2(run_dir: str):
    return _interrupted_and_resumed(run_dir, dp=2)


def test_resume_on_two_ranks(tmp_path):
    results = run_distributed(_dp2, 2, str(tmp_path), timeout=400)
    reference, cut, start = results[0]
    assert start == 4 and cut == reference
