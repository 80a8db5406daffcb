"""The ``plait`` command and the job layer: subcommands, the config reference, unknown keys, tokenizers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from plait.loop import ConfigError, load_config
from plait.loop.data import Corpus, tokenize_corpus
from plait.models import config_class_for, supported_model_types
from plait.train import JobConfig
from plait.train.cli import main as plait
from plait.train.reference import render_markdown
from plait.train.train import DEFAULT_CONFIG

REPO = Path(__file__).resolve().parents[2]


def _leaf_keys(cls, prefix=""):  # type: ignore[no-untyped-def]
    """Every leaf key of a config class, walked here independently of the reference generator."""
    from pydantic import BaseModel

    out = []
    for name, field in cls.model_fields.items():
        tp = field.annotation
        args = [a for arg in getattr(tp, "__args__", (tp,)) for a in (*getattr(arg, "__args__", ()), arg)]
        subs = [a for a in args if isinstance(a, type) and issubclass(a, BaseModel)]
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            subs = [tp]
        if subs and name != "model":
            for sub in subs:
                out += _leaf_keys(sub, f"{prefix}{name}.")
        elif name != "model":
            out.append(f"{prefix}{name}")
    return out


def test_config_keys_lists_every_key(capsys) -> None:
    plait(["config", "--keys"])
    text = capsys.readouterr().out
    listed = {
        line.split()[0].replace("[]", "") for line in text.splitlines() if line and not line.startswith(" ")
    }
    missing = [k for k in _leaf_keys(JobConfig) if k not in listed]
    assert not missing, missing
    assert "data.validation_documents" in listed and "optimizer.moment_dtype" in listed


def test_config_prints_the_resolved_config_with_overrides(capsys) -> None:
    plait(["config", "--run.steps=7", "--data.source=x.jsonl", "--model_dtype=bfloat16"])
    resolved = json.loads(capsys.readouterr().out)
    assert resolved["run"]["steps"] == 7 and resolved["data"]["source"] == "x.jsonl"
    assert resolved["model"]["model_type"] == "qwen3_moe"
    assert resolved["model_dtype"] == "bfloat16"  # a top-level key: no section


def test_the_docs_config_reference_is_generated_from_the_classes() -> None:
    models = {t: config_class_for(t) for t in supported_model_types()}
    page = (REPO / "docs" / "reference" / "config.md").read_text()
    assert page == render_markdown(JobConfig, models), (
        "regenerate: uv run plait config --markdown > docs/reference/config.md"
    )


@pytest.mark.parametrize(
    ("override", "suggestion"),
    [
        ("--data.text_feild=x", "did you mean `data.text_field`?"),
        ("--optimizer.lr_=1", "did you mean `optimizer.lr`?"),
        ("--model.hiden_size=3", "did you mean `model.hidden_size`?"),
        ("--evaluaton.enabled=false", "did you mean `evaluation`?"),
    ],
)
def test_an_unknown_key_names_the_nearest_and_the_reference(override: str, suggestion: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(DEFAULT_CONFIG, [override], cls=JobConfig)
    assert suggestion in str(e.value) and "plait config" in str(e.value)


def test_unknown_command_and_help(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        plait(["trian"])
    assert e.value.code == 2 and "unknown command 'trian'" in capsys.readouterr().err
    plait(["--help"])
    out = capsys.readouterr().out
    assert all(name in out for name in ("train", "finetune", "tokenize", "export", "config", "info"))


def test_python_dash_m_plait_runs_the_command() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "plait", "--help"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and "commands:" in proc.stdout, proc.stderr


def test_tokenize_with_bytes_and_training_defaults_to_the_recorded_tokenizer(tmp_path: Path, capsys) -> None:
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"document {i} " * 20}) + "\n" for i in range(40)))
    plait(
        ["tokenize", "--tokenizer", "bytes", "--output", str(tmp_path / "tok"), "--no-progress", str(corpus)]
    )
    meta = json.loads((tmp_path / "tok" / "meta.json").read_text())
    assert meta["tokenizer"] == "bytes" and meta["vocab_size"] == 259
    data = load_config(
        DEFAULT_CONFIG, [f"--data.source={tmp_path / 'tok'}", "--data.format=tokens"], cls=JobConfig
    ).data
    mapped = Corpus(data, 32)
    assert mapped.tokenizer.vocab_size == 259
    # the token file holds exactly the byte tokenizer's encoding of the documents (each ending in eos)
    direct = tokenize_corpus([corpus], "bytes", tmp_path / "again", progress=False)
    assert direct["num_tokens"] == meta["num_tokens"]


def test_init_from_a_small_vocabulary_with_its_own_tokenizer_is_accepted(tmp_path: Path, capsys) -> None:
    """A checkpoint whose vocabulary is smaller than the byte tokenizer's but that ships its own tokenizer:
    the tokenizer becomes the data's, and only it is checked against the vocabulary."""
    from plait.train.job import check_corpus
    from plait.train.train import main, parse_args

    from tests.loop._tiny_tokenizer import make_tokenizer

    seed = tmp_path / "seed"
    main(["--model.vocab_size=64", "--write-seed-checkpoint", str(seed), "--run-dir", str(tmp_path / "r")])
    make_tokenizer(seed, vocab_size=60)
    corpus = tmp_path / "one.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"line {i} of the file"}) + "\n" for i in range(200)))
    no_model = tmp_path / "job.toml"  # a config without [model]: the checkpoint's is the model
    no_model.write_text("[batching]\nseq_len = 32\nglobal_batch_size = 4\nmicrobatch_size = 4\n")
    common = ["--config", str(no_model), "--init-from", str(seed), "--run-dir", str(tmp_path / "r")]
    config, _ = parse_args([*common, f"--data.source={corpus}"])
    assert config.model.vocab_size == 64 and config.data.tokenizer == str(seed)
    check_corpus(config.data, 32, config.model.vocab_size, True, global_batch_size=4)
    with pytest.raises(ConfigError, match=r"model\.vocab_size=64 is smaller than the byte tokenizer's 259"):
        parse_args([*common, "--data.tokenizer=bytes"])
    # without a tokenizer of its own the default (bytes) is checked when the data is read, before the model
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(["--model.vocab_size=64", "--run-dir", str(tmp_path / "r2")])
    err = capsys.readouterr().err
    assert (
        e.value.code == 2 and "data.tokenizer: bytes has 259 token ids, more than model.vocab_size=64" in err
    )


def test_cuda_graphs_off_cuda_are_refused_before_anything_is_built() -> None:
    """``gpu1.toml`` replays its layers as CUDA graphs: run on the CPU it stops at the start-up check, naming
    both keys and the way out, not at the first forward."""
    from plait.train.job import check_startup

    gpu1 = REPO / "examples" / "qwen3_moe" / "configs" / "gpu1.toml"
    cfg = load_config(gpu1, ["--run.device=cpu"], cls=JobConfig)
    assert cfg.parallel.cuda_graphs
    with pytest.raises(
        ConfigError,
        match=r"parallel\.cuda_graphs needs run\.device=cuda, got 'cpu' \(set parallel\.cuda_graphs=false\)",
    ):
        check_startup(cfg, write_dirs={}, read_data=False)
    check_startup(load_config(gpu1, ["--run.device=cpu", "--parallel.cuda_graphs=false"], cls=JobConfig), write_dirs={}, read_data=False)  # fmt: skip
