"""The main job (``plait train``) trains every family's CPU config, and its
Hugging Face export loads in transformers with the logits plait computes."""

from __future__ import annotations

import pytest
import torch
import transformers
from plait.models import from_pretrained
from plait.train.train import main

from tests.e2e._pretrain_runner import REPO

EXAMPLES = REPO / "examples"
FAST = ["--batching.seq_len=64", "--batching.global_batch_size=4", "--batching.microbatch_size=4",
        "--data.max_files=8", "--logging.progress_bar=false", "--checkpoint.enabled=false",
        "--evaluation.enabled=false"]  # fmt: skip


# family -> the model_type of its export where it is not the family's name
MODEL_TYPES = {"qwen3_5": "qwen3_5_text"}


@pytest.mark.parametrize("family", ["llama", "gpt_oss", "deepseek_v3", "qwen3_5"])
def test_family_trains_and_exports_to_transformers(family, tmp_path):
    run_dir = tmp_path / "run"
    config = EXAMPLES / "configs" / family / "cpu.toml"
    metrics = main(["--config", str(config), "--steps", "3", "--run-dir", str(run_dir), *FAST])
    assert torch.isfinite(torch.tensor(metrics["loss"]))
    hf = transformers.AutoModelForCausalLM.from_pretrained(run_dir / "hf").eval()
    assert hf.config.model_type == MODEL_TYPES.get(family, family)
    ours = from_pretrained(run_dir / "hf").eval()
    ids = torch.randint(0, 259, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(input_ids=ids)["logits"], hf(ids).logits, atol=2e-5, rtol=1e-4)


def test_float8_trains_emulated_and_is_refused_without_a_float8_gpu(tmp_path, monkeypatch, capsys):
    """``[parallel.float8]``: emulated float8 linears train and export (parameter names unchanged);
    without ``emulate`` and without a float8-capable GPU the job stops before building anything."""
    pytest.importorskip("torchao.float8")
    config = EXAMPLES / "configs" / "llama" / "cpu.toml"
    run_dir = tmp_path / "run"
    argv = ["--config", str(config), "--steps", "2", "--run-dir", str(run_dir), *FAST]
    metrics = main([*argv, "--parallel.float8.recipe=rowwise", "--parallel.float8.emulate=true"])
    assert torch.isfinite(torch.tensor(metrics["loss"]))
    assert from_pretrained(run_dir / "hf").config.hidden_size == 128
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--run-dir", str(tmp_path / "refused"), "--parallel.float8.recipe=tensorwise"])
    assert exc.value.code == 2
    assert "parallel.float8 needs an NVIDIA GPU of compute capability 8.9+" in capsys.readouterr().err


def test_qwen3_next_pipeline_parallel_matches_one_process(tmp_path):
    """Qwen3-Next (gated DeltaNet and gated attention layers, MoE) in 2 pipeline stages (1F1B, gloo):
    each stage keeps its layers' global indices (their ``layer_types``), and from one seed checkpoint
    the loss curve equals the one-process curve."""
    from plait.dist_core.testing import run_distributed

    from tests.e2e._pretrain_runner import losses, run

    config = EXAMPLES / "configs" / "qwen3_5" / "moe_cpu.toml"
    seed = tmp_path / "seed"
    run(["--config", str(config), "--write-seed-checkpoint", str(seed)])
    argv = ["--config", str(config), "--init-from", str(seed), "--steps", "4", *FAST,
            "--batching.global_batch_size=8", "--batching.microbatch_size=2", "--logging.interval=1",
            "--no-export"]  # fmt: skip
    run([*argv, "--run-dir", str(tmp_path / "one")])
    run_distributed(run, 2, [*argv, "--run-dir", str(tmp_path / "pp2"), "--mesh.pipeline=2",
                             "--pipeline.kind=1f1b"], timeout=200)  # fmt: skip
    one, pp2 = losses(tmp_path / "one"), losses(tmp_path / "pp2")
    assert sorted(one) == sorted(pp2) == [1, 2, 3, 4]
    torch.testing.assert_close(
        torch.tensor([pp2[s] for s in one], dtype=torch.float64),
        torch.tensor([one[s] for s in one], dtype=torch.float64),
        rtol=1e-4, atol=0,
    )  # fmt: skip
