"""The tokenize command: its tokens are the tokenizer's (transformers') in-process ids, its output is
read memory-mapped and gives the rows the in-memory path gives, bad input is one line and status 2."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import transformers
from plait.loop.data import HFTokenizer, build_packed_corpus, resolve_source
from plait.loop.data.__main__ import main

from tests.loop._tiny_tokenizer import CORPUS, make_tokenizer

TEXTS = [f"{CORPUS[i % 4]} {CORPUS[(i * 3) % 4]} number {i}" for i in range(300)]


def _corpus(root):
    root.mkdir()
    for k in range(3):
        lines = [json.dumps({"text": t}) for t in TEXTS[k * 100 : (k + 1) * 100]]
        (root / f"part{k}.jsonl").write_text("\n".join(lines) + "\n")
    return root


def test_tokenize_command_writes_the_tokenizers_ids_and_an_index(tmp_path):
    tok_dir = make_tokenizer(tmp_path / "tok")
    corpus = _corpus(tmp_path / "corpus")
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "plait.loop.data", "tokenize", "--tokenizer", str(tok_dir), "--output", str(out),
           "--workers", "2", "--batch-size", "16", str(corpus / "part0.jsonl"), str(corpus / "part[12].jsonl")]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "tokenize: 100%" in done.stderr or "300 docs" in done.stderr  # the progress bar
    reference = transformers.AutoTokenizer.from_pretrained(tok_dir)
    docs = [[*reference(t)["input_ids"], reference.eos_token_id] for t in TEXTS]
    meta = json.loads((out / "meta.json").read_text())
    assert meta["dtype"] == "uint16" and meta["num_documents"] == 300
    tokens = np.fromfile(out / "corpus.tokens", dtype=np.uint16)
    assert tokens.tolist() == [t for d in docs for t in d]
    starts = np.cumsum([0, *map(len, docs)])[:-1]
    assert np.load(out / "documents.npy").tolist() == starts.tolist()


def test_the_tokens_format_reads_the_output_memory_mapped_as_the_in_memory_path(tmp_path):
    tok_dir = make_tokenizer(tmp_path / "tok")
    corpus = _corpus(tmp_path / "corpus")
    assert main(["tokenize", "--tokenizer", str(tok_dir), "--output", str(tmp_path / "out"),
                 "--workers", "1", "--no-progress", str(corpus)]) == 0  # fmt: skip
    tok = HFTokenizer(tok_dir)
    mapped = build_packed_corpus(resolve_source(tmp_path / "out"), 24, tok, "tokens")
    in_memory = build_packed_corpus(resolve_source(corpus), 24, tok, "jsonl")
    assert isinstance(mapped.tokens, np.memmap) and len(mapped) == len(in_memory)
    for i in range(len(mapped)):
        a, b = mapped[i], in_memory[i]
        assert {k: v.tolist() for k, v in a.items()} == {k: v.tolist() for k, v in b.items()}


def test_bad_input_is_one_line_and_status_2(tmp_path, capsys):
    tok_dir = make_tokenizer(tmp_path / "tok")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a"}\n{"text": 3}\n')
    for argv, want in (
        ([str(bad)], f"{bad}:2: field 'text' missing or not a string"),
        ([str(tmp_path / "nope")], f"data.source: {tmp_path / 'nope'} does not exist"),
    ):
        code = main(["tokenize", "--tokenizer", str(tok_dir), "--output", str(tmp_path / "o"), "--workers", "2",
                     "--no-progress", *argv])  # fmt: skip
        err = capsys.readouterr().err
        assert code == 2 and want in err and err.count("\n") == 1, err
    assert not (tmp_path / "o" / "corpus.tokens").exists()
    small = make_tokenizer(tmp_path / "small", vocab_size=40)
    (tmp_path / "a.txt").write_text(" ".join(CORPUS))
    main(["tokenize", "--tokenizer", str(tok_dir), "--output", str(tmp_path / "t"), "--no-progress", "--workers",
          "1", str(tmp_path / "a.txt")])  # fmt: skip
    with pytest.raises(ValueError, match="tokenized with a tokenizer of"):
        build_packed_corpus(resolve_source(tmp_path / "t"), 4, HFTokenizer(small), "tokens")


@pytest.mark.parametrize("loss_on", ["assistant", "all"])
def test_tokenized_chats_give_the_rows_of_the_chat_format(tmp_path, loss_on):
    from tests.loop.test_chat import CHATS, make_chat_tokenizer

    tok_dir = make_chat_tokenizer(tmp_path / "tok")
    chats = tmp_path / "c.jsonl"
    chats.write_text("".join(json.dumps({"messages": m}) + "\n" for m in CHATS[:2] * 20))
    assert main(["tokenize", "--tokenizer", str(tok_dir), "--output", str(tmp_path / "out"), "--format", "chat",
                 "--workers", "2", "--batch-size", "8", "--no-progress", str(chats)]) == 0  # fmt: skip
    tok = HFTokenizer(tok_dir)
    mapped = build_packed_corpus(resolve_source(tmp_path / "out"), 16, tok, "tokens", loss_on=loss_on)
    direct = build_packed_corpus([chats], 16, tok, "chat", loss_on=loss_on)
    assert isinstance(mapped.tokens, np.memmap) and len(mapped) == len(direct)
    for i in range(len(mapped)):
        a, b = mapped[i], direct[i]
        assert {k: v.tolist() for k, v in a.items()} == {k: v.tolist() for k, v in b.items()}


def test_a_chat_the_template_refuses_is_named_from_a_worker(tmp_path, capsys):
    from tests.loop.test_chat import CHATS, make_chat_tokenizer

    tok_dir = make_chat_tokenizer(tmp_path / "tok")
    chats = tmp_path / "c.jsonl"
    bad = [{"role": "tool", "content": "x"}, CHATS[0][1]]  # the template raises on the tool role
    chats.write_text("".join(json.dumps({"messages": m}) + "\n" for m in [*CHATS[:2] * 5, bad]))
    code = main(["tokenize", "--tokenizer", str(tok_dir), "--output", str(tmp_path / "out"), "--format", "chat",
                 "--workers", "2", "--batch-size", "4", "--no-progress", str(chats)])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and f"{chats}:11: the chat template failed: unsupported role tool" in err, err
    assert err.count("\n") == 1 and not (tmp_path / "out" / "corpus.tokens").exists()


def test_a_chat_without_assistant_tokens_is_refused_as_the_chat_format_refuses_it(tmp_path, capsys):
    from tests.loop.test_chat import CHATS, TEMPLATE, make_chat_tokenizer

    # no eos after an assistant turn: an empty last turn renders no assistant token
    template = TEMPLATE.replace("{{ eos_token }}{% endgeneration %}", "{% endgeneration %}")
    tok_dir = make_chat_tokenizer(tmp_path / "tok", template)
    empty = [CHATS[0][0], {"role": "assistant", "content": ""}]
    reference = transformers.AutoTokenizer.from_pretrained(tok_dir)
    masks = [reference.apply_chat_template(m, return_dict=True, return_assistant_tokens_mask=True)["assistant_masks"]
             for m in (CHATS[0], empty)]  # fmt: skip
    assert any(masks[0]) and not any(masks[1])
    chats = tmp_path / "c.jsonl"
    chats.write_text("".join(json.dumps({"messages": m}) + "\n" for m in [*CHATS[:2] * 5, empty, CHATS[0]]))
    want = f"{chats}:11: the chat template renders no assistant token for this record"
    with pytest.raises(ValueError, match=want):
        build_packed_corpus([chats], 8, HFTokenizer(tok_dir), "chat", loss_on="assistant")
    code = main(["tokenize", "--tokenizer", str(tok_dir), "--output", str(tmp_path / "out"), "--format", "chat",
                 "--workers", "2", "--batch-size", "4", "--no-progress", str(chats)])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and want in err and err.count("\n") == 1, err
    assert not (tmp_path / "out" / "corpus.tokens").exists()
