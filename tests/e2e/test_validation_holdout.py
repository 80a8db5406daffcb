"""The main job's validation data held out by documents: one JSONL file works with the default config,
the split is seeded and the same for any world size, a few files fall back to documents, and a
separate validation source is read alone."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from plait.loop.data import (
    ByteTokenizer,
    DataSourceError,
    DocumentHoldout,
    build_packed_splits,
    corpus_files,
    validation_mode,
)
from plait.train.train import main, parse_args

from tests.e2e._pretrain_runner import dataset
from tests.e2e.test_pretrain_cli import TINY

TEXTS = [f"record {i}: " + "the quick brown fox jumps over the lazy dog " * (1 + i % 3) for i in range(60)]


def _write_jsonl(path, texts):
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def _documents(ds) -> list[str]:
    """The documents of a byte-level packed dataset, decoded."""
    eos = ByteTokenizer().eos_id
    tokens = np.asarray(ds.tokens).tolist()
    docs, current = [], []
    for t in tokens:
        if t == eos:
            docs.append(ByteTokenizer().decode(current))
            current = []
        else:
            current.append(t)
    return docs


def test_document_holdout_is_seeded_disjoint_and_counts_or_fractions():
    a, b = DocumentHoldout(0.1, seed=3), DocumentHoldout(0.1, seed=4)
    assert a.held_out(100).tolist() == DocumentHoldout(0.1, seed=3).held_out(100).tolist()
    assert len(a.held_out(100)) == 10 and a.held_out(100).tolist() != b.held_out(100).tolist()
    assert DocumentHoldout(7).held_out(100).size == 7
    assert DocumentHoldout(0.01).held_out(5).size == 1  # at least one
    with pytest.raises(ValueError, match="holding out 5 of 5 document"):
        DocumentHoldout(5).held_out(5)


def test_split_documents_are_never_trained_on(tmp_path):
    files = [_write_jsonl(tmp_path / "one.jsonl", TEXTS)]
    train, val = build_packed_splits(files, 16, ByteTokenizer(), DocumentHoldout(6, seed=1))
    held, kept = _documents(val), _documents(train)
    assert len(held) == 6 and len(kept) == 54
    assert sorted(held + kept) == sorted(TEXTS) and not set(held) & set(kept)
    assert kept == [t for t in TEXTS if t not in held]  # training keeps the file's order
    with pytest.raises(DataSourceError, match="documents cannot be held out of token files"):
        build_packed_splits([tmp_path / "x.tokens"], 16, ByteTokenizer(), DocumentHoldout(1), "tokens")


def test_one_jsonl_file_trains_and_validates_with_the_default_config(tmp_path, capsys, monkeypatch):
    """Today: ``data.source: 1 file(s) in one.jsonl, not more than data.validation_files=8``."""
    source = _write_jsonl(tmp_path / "one.jsonl", TEXTS)
    argv = [*TINY, "--steps", "1", "--no-export", "--run-dir", str(tmp_path / "run"),
            f"--data.source={source}", "--batching.seq_len=32", "--evaluation.enabled=true"]  # fmt: skip
    config, _ = parse_args(argv)
    train = dataset(config.data, 32)
    val = dataset(config.data, 32, "validation")
    assert "holding out 3 of its 60 documents for validation instead" in capsys.readouterr().err
    assert not set(_documents(train)) & set(_documents(val))
    # the split depends on the documents and the seed only: another world size, rank or process
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    again = dataset(config.data, 32, "validation")
    assert np.asarray(again.tokens).tolist() == np.asarray(val.tokens).tolist()
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.delenv("RANK")
    other = config.data.model_copy(update={"validation_seed": 1})
    assert np.asarray(dataset(other, 32, "validation").tokens).tolist() != np.asarray(val.tokens).tolist()
    metrics = main(argv)
    assert torch.isfinite(torch.tensor(metrics["val_loss"]))


def test_a_folder_of_few_files_holds_out_documents_and_many_files_hold_out_files(tmp_path):
    few = tmp_path / "few"
    few.mkdir()
    for k in range(3):
        _write_jsonl(few / f"part{k}.jsonl", TEXTS[k * 20 : (k + 1) * 20])
    config, _ = parse_args([*TINY, f"--data.source={few}", "--data.validation_documents=5"])
    assert validation_mode(config.data, 3) == "documents"
    assert len(_documents(dataset(config.data, 32, "validation"))) == 5
    assert corpus_files(config.data, "validation") == sorted(few.glob("*.jsonl"))
    files, _ = parse_args([*TINY, f"--data.source={few}", "--data.validation_files=1"])
    assert corpus_files(files.data, "validation") == [few / "part2.jsonl"]
    forced, _ = parse_args([*TINY, f"--data.source={few}", "--data.validation_split=files"])
    with pytest.raises(DataSourceError, match=r"data.source: 3 file\(s\) in .* data.validation_files=8"):
        corpus_files(forced.data)


def test_a_separate_validation_source_is_read_alone(tmp_path):
    train_file = _write_jsonl(tmp_path / "train.jsonl", TEXTS[:50])
    val_file = _write_jsonl(tmp_path / "val.jsonl", TEXTS[50:])
    config, _ = parse_args([*TINY, f"--data.source={train_file}", f"--data.validation_source={val_file}"])
    assert sorted(_documents(dataset(config.data, 32, "validation"))) == sorted(TEXTS[50:])
    assert sorted(_documents(dataset(config.data, 32))) == sorted(TEXTS[:50])
