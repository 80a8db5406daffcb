"""The main job's ``[data]``: JSONL / parquet sources, a Hugging Face tokenizer (also --init-from's),
its export next to the model, and bad input stopped before the model is built."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers
from plait.train.train import DEFAULT_CONFIG, main, parse_args

from tests.e2e._pretrain_runner import FAST, dataset
from tests.e2e.test_pretrain_cli import TINY, _fails, pretrain  # noqa: F401  (the fixture)
from tests.loop._tiny_tokenizer import CORPUS, make_tokenizer

TEXTS = [f"{CORPUS[i % 4]} {CORPUS[(i * 3) % 4]} number {i}" for i in range(40)]


def _jsonl_corpus(root):
    root.mkdir()
    for k in range(4):  # the last file is held out for validation
        lines = [json.dumps({"id": i, "text": t}) for i, t in enumerate(TEXTS[k * 10 : (k + 1) * 10])]
        (root / f"part{k}.jsonl").write_text("\n".join(lines) + "\n")
    return root


def test_jsonl_with_a_tokenizer_trains_and_exports_it(tmp_path):
    tok_dir = make_tokenizer(tmp_path / "tok")
    corpus = _jsonl_corpus(tmp_path / "corpus")
    run_dir = tmp_path / "run"
    argv = [*TINY, "--steps", "2", "--run-dir", str(run_dir), f"--data.source={corpus}",
            f"--data.tokenizer={tok_dir}", "--data.validation_files=1", "--evaluation.enabled=false"]  # fmt: skip
    config, _ = parse_args(argv)
    # the training rows are the first three files' texts as transformers tokenises them, each + eos
    reference = transformers.AutoTokenizer.from_pretrained(tok_dir)
    stream = [t for text in TEXTS[:30] for t in [*reference(text)["input_ids"], reference.eos_token_id]]
    ds = dataset(config.data, config.batching.seq_len)
    assert np.asarray(ds.tokens).tolist() == stream
    assert np.asarray(dataset(config.data, 64, "validation").tokens).max() < 60
    metrics = main(argv)
    assert torch.isfinite(torch.tensor(metrics["loss"]))
    exported = transformers.AutoTokenizer.from_pretrained(run_dir / "hf")
    assert exported(TEXTS[0])["input_ids"] == reference(TEXTS[0])["input_ids"]
    assert transformers.AutoModelForCausalLM.from_pretrained(run_dir / "hf").config.model_type == "qwen3_moe"


def test_init_from_a_checkpoint_with_a_tokenizer_makes_it_the_default(tmp_path):
    seed = tmp_path / "seed"
    main([*FAST, "--write-seed-checkpoint", str(seed)])
    make_tokenizer(seed)
    config, _ = parse_args(["--init-from", str(seed), "--run-dir", str(tmp_path / "r")])
    assert config.data.tokenizer == str(seed)
    config, _ = parse_args(["--init-from", str(seed), "--data.tokenizer=bytes", "--run-dir", "r"])
    assert config.data.tokenizer == "bytes"
    config, _ = parse_args(["--run-dir", str(tmp_path / "r")])
    assert config.data.tokenizer is None  # bytes


def test_bad_data_is_one_line_and_exit_2_before_the_model(pretrain, capsys, tmp_path):  # noqa: F811
    import pyarrow as pa
    import pyarrow.parquet as pq

    run = ["--run-dir", str(tmp_path / "r"), "--data.validation_files=0", "--evaluation.enabled=false"]
    tok_dir = make_tokenizer(tmp_path / "tok")
    big = transformers.AutoTokenizer.from_pretrained(tok_dir)
    (tmp_path / "ok.jsonl").write_text(json.dumps({"text": " ".join(CORPUS)}) + "\n")
    err = _fails(pretrain, capsys, [*run, f"--data.source={tmp_path / 'ok.jsonl'}", f"--data.tokenizer={tok_dir}",
                                    "--model.vocab_size=40"])  # fmt: skip
    assert f"data.tokenizer: {tok_dir} has {len(big)} token ids, more than model.vocab_size=40" in err
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n{"text": "b"\n')
    err = _fails(pretrain, capsys, [*run, f"--data.source={tmp_path / 'bad.jsonl'}"])
    assert f"{tmp_path / 'bad.jsonl'}:2: not valid JSON" in err and err.count("\n") == 1
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "a.parquet")
    err = _fails(pretrain, capsys, [*run, f"--data.source={tmp_path / 'a.parquet'}"])
    assert f"{tmp_path / 'a.parquet'}: no column 'text' (columns: body)" in err
    (tmp_path / "w.bin").write_bytes(b"\x00\x01\x02")
    err = _fails(pretrain, capsys, [*run, f"--data.source={tmp_path / 'w.bin'}"])
    assert f"{tmp_path / 'w.bin'}: cannot tell the format from the extension '.bin'" in err
    err = _fails(pretrain, capsys, [*run[:2], f"--data.source={tmp_path / 'ok.jsonl'}"])
    assert "data.validation_documents=0.05: data.source: holding out 1 of 1 document(s) leaves none" in err
    err = _fails(pretrain, capsys, [*run[:3], f"--data.source={tmp_path / 'ok.jsonl'}"])
    assert "data.validation_files=0 holds out nothing for evaluation.enabled=true" in err
    err = _fails(
        pretrain, capsys, [*run, f"--data.source={tmp_path / 'ok.jsonl'}", f"--data.tokenizer={tmp_path}"]
    )
    assert f"data.tokenizer: {tmp_path} holds no tokenizer.json" in err


def _mixture_config(tmp_path, weight_b: str = "1.0", pattern_b: str = "*.jsonl"):
    tok_dir = make_tokenizer(tmp_path / "tok")
    a, b = _jsonl_corpus(tmp_path / "a"), _jsonl_corpus(tmp_path / "b")
    config_file = tmp_path / "mix.toml"
    head = DEFAULT_CONFIG.read_text().split("[data]")[0]  # the default config, another [data]
    config_file.write_text(
        head + f'[data]\ntokenizer = "{tok_dir}"\nvalidation_files = 1\n'
        f'[[data.mixture]]\nsource = "{a}"\nweight = 3\n'
        f'[[data.mixture]]\nsource = "{b}/{pattern_b}"\nformat = "jsonl"\nweight = {weight_b}\n'
    )
    argv = [
        "--config",
        str(config_file),
        *TINY,
        "--run-dir",
        str(tmp_path / "run"),
        "--evaluation.enabled=false",
    ]
    return argv, a, b


def test_a_weighted_mixture_of_sources_trains(tmp_path):
    argv, a, b = _mixture_config(tmp_path)
    config, _ = parse_args(argv)
    ds = dataset(config.data, 16)
    alone = [dataset(config.data.model_copy(update={"mixture": (), "source": str(s)}), 16) for s in (a, b)]
    assert len(ds) == len(alone[0]) + len(alone[1])
    assert abs(ds.counts[0] - 3 * len(ds) / 4) < 1 and sum(ds.counts) == len(ds)
    for i in range(len(ds)):
        k, j = int(ds.source[i]), int(ds.index[i])
        assert ds[i]["input_ids"].tolist() == alone[k][j]["input_ids"].tolist()
    assert torch.isfinite(torch.tensor(main([*argv, "--steps", "1", "--no-export"])["loss"]))


def test_a_bad_mixture_table_is_named(tmp_path, pretrain, capsys):  # noqa: F811
    argv, _, b = _mixture_config(tmp_path, weight_b="0")
    err = _fails(pretrain, capsys, argv)
    assert "data.mixture.1.weight" in err and "greater than 0" in err
    argv, _, b = _mixture_config(tmp_path / "x", pattern_b="*.txt")
    err = _fails(pretrain, capsys, argv)
    assert f"data.mixture[1].source: no files match {b}/*.txt" in err and err.count("\n") == 1
    err = _fails(pretrain, capsys, [*argv, f"--data.source={b}"])
    assert "data.source and data.mixture: give one" in err


def test_a_tokenized_directory_is_the_same_rows_memory_mapped(tmp_path):
    from plait.loop.data.__main__ import main as data_cli

    tok_dir = make_tokenizer(tmp_path / "tok")
    corpus = _jsonl_corpus(tmp_path / "corpus")
    assert data_cli(["tokenize", "--tokenizer", str(tok_dir), "--output", str(tmp_path / "out"), "--workers", "1",
                     "--no-progress", str(corpus)]) == 0  # fmt: skip
    common = [*TINY, f"--data.tokenizer={tok_dir}", "--data.validation_files=0", "--evaluation.enabled=false"]
    mapped, _ = parse_args([*common, f"--data.source={tmp_path / 'out'}", "--data.format=tokens"])
    jsonl, _ = parse_args([*common, f"--data.source={corpus}"])
    a, b = dataset(mapped.data, 32), dataset(jsonl.data, 32)
    assert isinstance(a.tokens, np.memmap) and len(a) == len(b)
    for i in range(len(a)):
        assert all(torch.equal(a[i][k], b[i][k]) for k in b[i])


def test_a_mixture_run_resumes_exactly_from_its_checkpoint(tmp_path, capsys):
    """The loader state of a mixture (with its sizes, weights and seed) goes through the checkpoint: a
    run resumed at step 2 trains steps 3-4 on the same rows, with the same losses, as the run that went on."""
    import shutil

    from tests.e2e._pretrain_runner import losses

    argv, _, _ = _mixture_config(tmp_path)
    argv = [a for a in argv if a != "--checkpoint.enabled=false"]
    argv += ["--steps", "4", "--checkpoint.interval=2", "--checkpoint.keep_last=2", "--no-export"]
    main(argv)
    went_on = losses(tmp_path / "run")
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "step_00000004")
    (tmp_path / "run" / "metrics.jsonl").unlink()
    main(argv)
    assert losses(tmp_path / "run") == {3: went_on[3], 4: went_on[4]}
    # a source that grew since the checkpoint: the resume is refused in one line naming the mixture
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "step_00000004")
    extra = next(iter(sorted((tmp_path / "b").glob("*.jsonl"))))
    extra.write_text(extra.read_text() * 3)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "data.mixture: the sources' sizes were" in err and "Traceback" not in err, err[-2000:]
