"""The main job's command line: errors before anything is built, signal exits, the run summary, the
README's parameter count."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest
import torch
from plait.loop import ConfigError, load_config
from plait.train import JobConfig
from plait.train.train import DEFAULT_CONFIG, main, parse_args

from tests.e2e._pretrain_runner import FAST, REPO, TRAIN_CMD

TINY = [*FAST, "--batching.global_batch_size=4", "--batching.microbatch_size=4", "--checkpoint.enabled=false"]


@pytest.fixture
def pretrain(monkeypatch):
    """Model construction forbidden: errors must come before it."""
    import plait.train.job

    def no_model(*a, **k):  # type: ignore[no-untyped-def]
        raise AssertionError("the model was built before the error was reported")

    monkeypatch.setattr(plait.train.job, "CausalLMProvider", no_model)


def _fails(pretrain, capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


# -- conflicts between sections name both fields ----------------------------------------------------
def test_conflicting_sections_are_config_errors_naming_both_fields(pretrain):
    cls, cfg = JobConfig, DEFAULT_CONFIG
    with pytest.raises(
        ConfigError, match=r"batching\.seq_len=2048 is larger than model\.max_position_embeddings=1024"
    ):
        load_config(cfg, ["--batching.seq_len=2048"], cls=cls)
    with pytest.raises(ConfigError, match=r"model\.vocab_size=200 is smaller than the byte tokenizer's 259"):
        load_config(cfg, ["--model.vocab_size=200", "--data.tokenizer=bytes"], cls=cls)
    with pytest.raises(
        ConfigError,
        match=r"model\.num_hidden_layers=2 is fewer than the 4 pipeline stages of mesh\.pipeline=2",
    ):
        load_config(cfg, ["--model.num_hidden_layers=2", "--mesh.pipeline=2", "--pipeline.kind=zbv"], cls=cls)
    with pytest.raises(
        ConfigError, match=r"model\.tie_word_embeddings=true cannot be split .* \(mesh\.pipeline=2\)"
    ):
        load_config(cfg, ["--model.tie_word_embeddings=true", "--mesh.pipeline=2"], cls=cls)
    ok = load_config(
        cfg, ["--model.num_hidden_layers=4", "--mesh.pipeline=2", "--pipeline.kind=zbv"], cls=cls
    )
    assert ok.num_pipeline_stages == 4
    selective = [
        "--mesh.pipeline=2",
        "--parallel.activation_checkpointing.mode=selective",
        "--batching.microbatch_size=1",
    ]
    for kind in ("zb1p", "zbv", "dualpipev"):  # their programs split a backward into input and weight passes
        with pytest.raises(
            ConfigError,
            match=rf"mode='selective' with eager layers \(parallel\.compile=false\) cannot run the {kind}",
        ):
            load_config(cfg, [*selective, f"--pipeline.kind={kind}"], cls=cls)
        load_config(cfg, [*selective, f"--pipeline.kind={kind}", "--parallel.compile=true"], cls=cls)
    load_config(cfg, [*selective, "--pipeline.kind=1f1b"], cls=cls)
    # CUDA graphs with several microbatches per step: their gradients accumulate (own_graph_gradients),
    # MoE experts in any dtype (float32's grouped GEMM keeps its group sizes on the device too)
    graphs = ["--parallel.compile=true", "--parallel.cuda_graphs=true"]
    for dtype in ("--model_dtype=bfloat16", "--parallel.param_dtype=bfloat16", "--model_dtype=float32"):
        load_config(cfg, [*graphs, dtype], cls=cls)


def test_eager_selective_checkpointing_allows_one_backward_per_region():
    """What refuses selective checkpointing with eager layers under a split-backward schedule: torch's own
    rule. A checkpointed region's input gradients, then (graph kept) its weight gradients, as the schedules'
    I and W passes take them: the second pass fails under the selective policy, not under full checkpointing."""
    import functools

    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    lin = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)

    def policy(ctx, op, *args, **kwargs):
        saved = str(op) in ("aten.mm.default", "aten.addmm.default")  # the matmuls, as save_ops keeps them
        return CheckpointPolicy.MUST_SAVE if saved else CheckpointPolicy.PREFER_RECOMPUTE

    def split_backward(**extra) -> None:
        y = checkpoint(lambda t: torch.relu(lin(t)).sin(), x, use_reentrant=False, **extra).sum()
        torch.autograd.grad(y, [x], retain_graph=True)
        torch.autograd.grad(y, list(lin.parameters()))

    split_backward()  # full checkpointing: recomputed once per pass
    with pytest.raises(RuntimeError, match="backward an extra time"):
        split_backward(context_fn=functools.partial(create_selective_checkpoint_contexts, policy))


# -- overrides by field type; no abbreviated or unknown flags ----------------------------------------
def test_numeric_run_name_and_unknown_or_abbreviated_flags(pretrain, capsys, tmp_path):
    config, _ = parse_args(["--run.name=2024", "--run-dir", str(tmp_path)])
    assert config.run.name == "2024"
    assert "unrecognized arguments: --step 3" in _fails(pretrain, capsys, ["--step", "3"])
    assert "unrecognized arguments: --bogus" in _fails(pretrain, capsys, ["--bogus"])
    assert "unrecognized arguments: --run.steps 3" in _fails(pretrain, capsys, ["--run.steps", "3"])


# -- one message, exit 2, nothing built ----------------------------------------------------------------
def test_startup_errors_are_one_message_before_anything_is_built(pretrain, capsys, tmp_path):
    err = _fails(pretrain, capsys, ["--config", str(tmp_path / "missing.toml")])
    assert f"error: config file {tmp_path / 'missing.toml'} does not exist" in err
    err = _fails(pretrain, capsys, ["--optimizer.lr=-1", "--run-dir", str(tmp_path)])
    assert "optimizer.lr: Input should be greater than 0" in err
    (tmp_path / "empty").mkdir()
    err = _fails(pretrain, capsys, ["--init-from", str(tmp_path / "empty"), "--run-dir", str(tmp_path / "r")])
    assert f"--init-from: {tmp_path / 'empty'} holds no *.safetensors files" in err
    blocker = tmp_path / "file"
    blocker.write_text("")
    err = _fails(pretrain, capsys, ["--run-dir", str(blocker / "run")])
    assert f"run.run_dir: cannot write to {blocker / 'run'}" in err


def test_data_source_errors_come_before_the_model(pretrain, capsys, tmp_path):
    err = _fails(
        pretrain, capsys, [f"--data.source={tmp_path / 'nowhere'}", "--run-dir", str(tmp_path / "r")]
    )
    assert f"data.source: {tmp_path / 'nowhere'} does not exist" in err
    (tmp_path / "empty").mkdir()
    err = _fails(pretrain, capsys, [f"--data.source={tmp_path / 'empty'}", "--run-dir", str(tmp_path / "r")])
    assert f"data.source: no files matching '*' under {tmp_path / 'empty'}" in err


def test_init_from_adopts_the_checkpoint_config_and_names_each_mismatch(pretrain, capsys, tmp_path):
    """--init-from reads config.json: agreeing [model] keys pass, training-only ones override (logged),
    architecture keys that differ are refused naming both values; a Llama checkpoint is a Llama run."""
    from plait.models import save_hf_config
    from plait.models.llama import LlamaConfig

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "model.safetensors").write_bytes(b"")  # only the config is read before anything is built
    config, _ = parse_args(["--run-dir", str(tmp_path / "r")])
    theirs = config.model.model_copy(update={"hidden_size": 64, "intermediate_size": 100})
    save_hf_config(theirs, ckpt)
    err = _fails(pretrain, capsys, ["--init-from", str(ckpt), "--run-dir", str(tmp_path / "r")])
    assert "model.hidden_size: the run sets 128, " in err and "config.json has 64" in err
    assert "model.intermediate_size: the run sets 384, " in err
    # A key the run does not set (rope_theta here) is the checkpoint's; training-only keys override.
    rope = config.model.rope_parameters.model_copy(update={"rope_theta": 5e5})
    save_hf_config(config.model.model_copy(update={"rope_parameters": rope}), ckpt)
    adopted, _ = parse_args(
        ["--init-from", str(ckpt), "--run-dir", str(tmp_path / "r"), "--model.attn_implementation=sdpa"]
    )
    assert adopted.model.attn_implementation == "sdpa" and adopted.model.rope_parameters.rope_theta == 5e5
    llama = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=1)  # fmt: skip
    save_hf_config(llama, ckpt)
    err = _fails(pretrain, capsys, ["--init-from", str(ckpt), "--run-dir", str(tmp_path / "r")])
    assert "model.model_type: the run sets 'qwen3_moe'" in err and "'llama'" in err
    cfg_file = tmp_path / "no_model.toml"
    cfg_file.write_text("[run]\nsteps = 1\n")
    adopted, _ = parse_args(["--config", str(cfg_file), "--init-from", str(ckpt)])
    assert isinstance(adopted.model, LlamaConfig) and (adopted.model.hidden_size, adopted.model.kv_heads) == (
        64,
        1,
    )
    with pytest.raises(ConfigError, match="no \\[model\\] section"):
        parse_args(["--config", str(cfg_file)])


# -- signals exit 128 + signum after the final checkpoint, without the export --------------------------
def _start(run_dir: Path, *extra: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in {"RANK", "WORLD_SIZE", "LOCAL_RANK"}}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [*TRAIN_CMD, "--steps", "10000", "--run-dir", str(run_dir), *TINY, *extra]
    return subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _stop_after_first_step(proc: subprocess.Popen, signum: int) -> str:
    seen = []
    assert proc.stdout is not None
    for line in proc.stdout:
        seen.append(line)
        if re.search(r"step 1/10000", line):
            proc.send_signal(signum)
            break
    out, _ = proc.communicate(timeout=300)
    return "".join(seen) + out


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_saves_then_exits_128_plus_signum_without_export(tmp_path, signum):
    run_dir = tmp_path / "run"
    proc = _start(run_dir, "--checkpoint.enabled=true", "--checkpoint.async_mode=thread")
    out = _stop_after_first_step(proc, signum)
    assert proc.returncode == 128 + signum, out[-3000:]
    checkpoints = sorted((run_dir / "checkpoints").glob("step_*"))
    assert checkpoints and (checkpoints[-1] / "plait_checkpoint.json").is_file(), out[-3000:]
    assert not (run_dir / "hf").exists()
    assert "no Hugging Face export of the unfinished run" in out and "Traceback" not in out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stopped_early"] is True and summary["export"] is None
    assert summary["checkpoint"] == str(checkpoints[-1])


def test_export_unfinished_writes_the_export_and_still_exits_143_also_without_checkpoints(tmp_path):
    """With checkpointing off the signal still ends the run at a step boundary: summary, export, 143."""
    run_dir = tmp_path / "run"
    proc = _start(run_dir, "--export-unfinished")  # TINY turns checkpointing off
    out = _stop_after_first_step(proc, signal.SIGTERM)
    assert proc.returncode == 143, out[-3000:]
    assert (run_dir / "hf" / "config.json").is_file() and "Traceback" not in out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stopped_early"] is True and summary["export"] == str(run_dir / "hf")


# -- the end-of-run summary and loss curve; the README's parameter count -------------------------------
def test_run_writes_summary_and_loss_curve(tmp_path):
    run_dir = tmp_path / "run"
    main(["--steps", "3", "--run-dir", str(run_dir), *TINY, "--no-export"])
    summary = json.loads((run_dir / "summary.json").read_text())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert summary["steps"] == 3 and summary["stopped_early"] is False and summary["steps_this_session"] == 3
    assert summary["tokens"] == 3 * 4 * 64  # steps x global batch x seq_len
    assert summary["final_loss"] == records[-1]["loss"]
    assert summary["mean_tokens_per_s"] == pytest.approx(summary["tokens"] / summary["wall_time_s"])
    assert summary["peak_memory_gib"] == max(r["max_rss_gib"] for r in records)
    assert summary["checkpoint"] is None and summary["export"] is None
    # steady state: the logging intervals after the first (one step each here), tokens over seconds
    rates = [r["tokens_per_s"] for r in records[1:]]
    assert summary["steady_steps"] == 2
    assert summary["steady_tokens_per_s"] == pytest.approx(len(rates) / sum(1 / r for r in rates), rel=1e-6)
    # a CPU has no meaningful peak: no MFU in the rows or the summary (nor its printed line)
    assert (
        all("mfu" not in r for r in records) and summary["steady_mfu"] is None and summary["mean_mfu"] is None
    )
    assert summary["last_val_loss"] == records[-1]["val_loss"] == summary["best_val_loss"]
    png = (run_dir / "loss_curve.png").read_bytes()
    assert png.startswith(b"\x89PNG")


def test_readme_parameter_count_matches_the_default_model():
    import torch
    from plait.models.qwen3 import Qwen3ForCausalLM

    config = load_config(DEFAULT_CONFIG, cls=JobConfig).model
    with torch.device("meta"):
        model = Qwen3ForCausalLM(config)
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    active = total - experts + experts * config.num_experts_per_tok // config.num_experts
    readme = (REPO / "README.md").read_text()
    m = re.search(r"~(\d+\.\d)M-parameter Qwen3-MoE \((\d+\.\d+)M active per token", readme)
    assert m, "README: the main job's parameter count"
    assert float(m.group(1)) == round(total / 1e6, 1) and float(m.group(2)) == round(active / 1e6, 2)
