"""Evaluation: val_loss / val_ppl every N steps and at the end, equal to a plain-PyTorch evaluation of the
same weights on the same held-out batches (1 process, DP, FSDP, PP); the validation position resumes."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
import torch.nn.functional as F
from plait.dist_core.testing import run_distributed
from plait.loop import CausalLMTask, DatasetProvider, ModuleProvider, Trainer, load_config, pack_documents

from tests.loop._lm import VOCAB, MeshContext, TinyLM, load_reference_weights, pattern_tokens, tiny_stage

GB = 8


def _train_data():
    return pack_documents(pattern_tokens(), 16, eos_id=VOCAB - 1)


def _validation_data():
    return pack_documents(pattern_tokens(128, seed=7), 16, eos_id=VOCAB - 1)


def _config(run_dir, *extra: str, steps: int = 4):
    return load_config(
        overrides=[
            f"--run.run_dir={run_dir}",
            f"--run.steps={steps}",
            f"--batching.global_batch_size={GB}",
            "--batching.microbatch_size=2",
            "--batching.seq_len=16",
            "--optimizer.lr=0.02",
            "--logging.progress_bar=false",
            "--evaluation.enabled=true",
            "--evaluation.interval=2",
            "--evaluation.steps=2",
            *extra,
        ]
    )


def _reference(model: torch.nn.Module, first_batch: int, batches: int) -> float:
    """Token-weighted cross-entropy (float64) of global validation batches [first, first + batches)."""
    data = _validation_data()
    ref = copy.deepcopy(model).double().eval()
    loss_sum, tokens = 0.0, 0
    with torch.no_grad():
        for i in range(first_batch * GB, (first_batch + batches) * GB):
            s = data[i]
            logits = ref(s["input_ids"][None])["logits"][0]
            loss_sum += F.cross_entropy(logits, s["labels"], ignore_index=-100, reduction="sum").item()
            tokens += int((s["labels"] != -100).sum())
    return loss_sum / tokens


def _provider(**kw) -> ModuleProvider:
    return ModuleProvider(TinyLM, initial_weights=load_reference_weights, **kw)


def test_evaluates_every_interval_and_at_the_end(tmp_path):
    torch.set_num_threads(1)
    cfg = _config(tmp_path, "--logging.interval=3", steps=5)
    data = DatasetProvider(_train_data(), validation=_validation_data())
    tr = Trainer(cfg, _provider(), data, CausalLMTask())
    summary = tr.fit()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    # Logging at 3 and 5, evaluation at 2, 4 and 5 (the end): one record per step that has either.
    assert [(r["step"], "loss" in r, "val_loss" in r) for r in records] == [
        (2, False, True),
        (3, True, False),
        (4, False, True),
        (5, True, True),
    ]
    # Three evaluations of 2 batches each; the last read validation batches 4 and 5 with the final weights.
    assert tr.app_state()["validation_data"].state_dict()["batches_consumed"] == 6
    want = _reference(tr.model_parts[0], 4, 2)
    assert summary["val_loss"] == pytest.approx(want, rel=1e-6)
    assert summary["val_ppl"] == pytest.approx(math.exp(want), rel=1e-6)
    assert records[-1]["val_loss"] == summary["val_loss"]
    assert tr.model_parts[0].training  # back in training mode
    tr.close()


def test_evaluation_needs_validation_data(tmp_path):
    with pytest.raises(ValueError, match=r"evaluation\.enabled is true but the data provider"):
        Trainer(_config(tmp_path), _provider(), DatasetProvider(_train_data()), CausalLMTask())


def _fsdp(module, ctx, config):
    from plait.dist_core import fully_shard_module

    return fully_shard_module(module, ctx.mesh_for("dense"))


def _distributed_eval(run_dir: str, layout: str) -> float:
    torch.set_num_threads(1)
    data = DatasetProvider(_train_data(), validation=_validation_data())
    if layout == "pp2":
        cfg = _config(run_dir, "--mesh.pipeline=2", "--pipeline.kind=1f1b")
        provider = ModuleProvider(tiny_stage, stages=True, initial_weights=load_reference_weights)
        tr = Trainer(cfg, provider, data, CausalLMTask(), ctx=MeshContext(2, 1))
    else:
        once = f"--fsdp.gather_once_per_step={str(layout == 'fsdp2-gather-once').lower()}"
        cfg = _config(run_dir, "--mesh.data_shard=2", once)
        fsdp = _fsdp if layout.startswith("fsdp2") else None
        tr = Trainer(cfg, _provider(parallelize_fn=fsdp), data, CausalLMTask())
        assert tr.evaluator is not None
        assert bool(tr.evaluator.executor.grad_sync.gathered) == (layout == "fsdp2-gather-once")
    out = [tr.evaluate()["val_loss"] for _ in range(2)]  # batches 0-1, then 2-3
    tr.close()
    return out


@pytest.mark.parametrize("layout", ["dp2", "fsdp2", "fsdp2-gather-once", "pp2"])
def test_distributed_validation_loss_matches_one_process(tmp_path, layout):
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = TinyLM()
    want = [_reference(model, 0, 2), _reference(model, 2, 2)]
    for rank, got in enumerate(run_distributed(_distributed_eval, 2, str(tmp_path), layout)):
        assert got == pytest.approx(want, rel=1e-6), f"{layout} rank {rank}"
