"""Data: packing, collation, bucketing, exact resume (also across dp sizes, for every source format),
readers, tokenizers."""

from __future__ import annotations

import collections
import itertools
import json
import logging
from typing import Any

import numpy as np
import pytest
import torch
from plait.loop import (
    ByteTokenizer,
    DistributedDataLoader,
    GlobalBatchPlan,
    HFTokenizer,
    PackedTokens,
    PadCollator,
    pack_documents,
    read_hf_texts,
    read_jsonl_texts,
    read_text_file,
    read_token_file,
    write_token_file,
)
from plait.loop.data import (
    ConcatenatedTokens,
    DataSourceError,
    MixtureDataset,
    build_packed_corpus,
    copy_tokenizer_files,
    read_documents,
    resolve_source,
    tokenize_corpus,
)

from tests.loop._tiny_tokenizer import make_tokenizer


def test_packing_matches_a_naive_reference():
    docs = [[1, 2, 3], [4, 5], [6, 7, 8, 9, 10], [11]]
    eos, seq = 0, 5
    ds = pack_documents(docs, seq, eos)
    stream = [t for d in docs for t in [*d, eos]]
    # Reference: walk the stream, tracking the document of every token.
    doc_of = []
    d = 0
    for i, t in enumerate(stream):
        doc_of.append(d)
        if t == eos:
            d += 1
        del i
    assert len(ds) == (len(stream) - 1) // seq
    for i in range(len(ds)):
        s = ds[i]
        lo = i * seq
        assert s["input_ids"].tolist() == stream[lo : lo + seq]
        local = [x - doc_of[lo] for x in doc_of[lo : lo + seq]]
        assert s["document_ids"].tolist() == local
        for j in range(seq):
            same = doc_of[lo + j] == doc_of[lo + j + 1]
            assert s["labels"][j].item() == (stream[lo + j + 1] if same else -100)
            start = max(k for k in range(lo, lo + j + 1) if k == lo or doc_of[k] != doc_of[k - 1])
            assert s["position_ids"][j].item() == lo + j - start


def test_collator_pads_and_masks():
    out = PadCollator(pad_id=9, pad_to_multiple_of=4)(
        [{"input_ids": [1, 2, 3], "labels": [2, 3, 4]}, {"input_ids": [5], "labels": [6]}]
    )
    assert out["input_ids"].tolist() == [[1, 2, 3, 9], [5, 9, 9, 9]]
    assert out["labels"].tolist() == [[2, 3, 4, -100], [6, -100, -100, -100]]
    assert out["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 0, 0, 0]]


def test_length_bucketing_reduces_padding_and_keeps_every_sample():
    lengths = [int(x) for x in torch.randint(1, 100, (64,), generator=torch.Generator().manual_seed(0))]
    plain = GlobalBatchPlan(64, 8, seed=1)
    bucketed = GlobalBatchPlan(64, 8, seed=1, lengths=lengths, bucket_buffer_batches=8)

    def padding(plan: GlobalBatchPlan) -> int:
        return sum(
            max(lengths[i] for i in b) * 8 - sum(lengths[i] for i in b)
            for b in map(plan.global_batch, range(8))
        )

    assert sorted(i for k in range(8) for i in bucketed.global_batch(k)) == list(range(64))
    assert padding(bucketed) < padding(plain) / 3


class _Ids(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        return {"input_ids": [i], "labels": [i]}


# Every source format the main job reads, each packed into rows as `build_packed_corpus` packs it for
# `examples/train.py` (`tokens`: the tokenize command's output; `tokens-raw`: two raw token files), plus
# a weighted mixture of formats and plain sample ids.
RESUME_SOURCES = ["ids", "text", "jsonl", "parquet", "arrow", "tokens", "tokens-chat", "tokens-raw", "chat", "mixture"]  # fmt: skip
SEQ = 6


def _texts(n: int) -> list[str]:
    from tests.loop._tiny_tokenizer import CORPUS

    return [" ".join(CORPUS[(i + j) % 4] for j in range(1 + i % 3)) for i in range(n)]


def _conversations(n: int) -> list[list[dict[str, str]]]:
    from tests.loop._tiny_tokenizer import CORPUS

    return [
        [{"role": "user", "content": CORPUS[i % 4]}, {"role": "assistant", "content": CORPUS[(i + 1) % 4]}]
        for i in range(n)
    ]


def _build_sources(root) -> dict[str, torch.utils.data.Dataset]:
    """Tiny corpora (65 rows of ``SEQ`` tokens; the mixture 195) in each format, written under ``root`` and
    packed."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tests.loop.test_chat import make_chat_tokenizer

    tok_dir = make_chat_tokenizer(root / "tok")
    tok = HFTokenizer(tok_dir)
    texts = _texts(36)
    (root / "txt").mkdir()
    for i, t in enumerate(texts):
        (root / "txt" / f"{i:02d}.txt").write_text(t)
    (root / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    table = pa.table({"text": texts})
    pq.write_table(table, root / "a.parquet", row_group_size=10)
    with pa.ipc.new_stream(root / "a.arrow", table.schema) as w:
        w.write_table(table)
    (root / "c.jsonl").write_text("".join(json.dumps({"messages": m}) + "\n" for m in _conversations(30)))
    files = {"text": root / "txt", "jsonl": root / "a.jsonl", "parquet": root / "a.parquet",
             "arrow": root / "a.arrow", "chat": root / "c.jsonl"}  # fmt: skip
    ds = {fmt: build_packed_corpus(resolve_source(path), SEQ, tok, fmt) for fmt, path in files.items()}
    for name, fmt, source in (("tokens", "jsonl", "a.jsonl"), ("tokens-chat", "chat", "c.jsonl")):
        tokenize_corpus([root / source], tok_dir, root / name, fmt=fmt, workers=1, progress=False)
        ds[name] = build_packed_corpus(resolve_source(root / name), SEQ, tok, "tokens")
    stream = np.asarray(ds["jsonl"].tokens)
    (root / "raw").mkdir()
    write_token_file(root / "raw" / "0.tokens", stream[:101])
    write_token_file(root / "raw" / "1.tokens", stream[101:])
    ds["tokens-raw"] = build_packed_corpus(resolve_source(root / "raw"), SEQ, tok, "tokens")
    ds["mixture"] = MixtureDataset([ds["parquet"], ds["chat"], ds["tokens-raw"]], [2.0, 1.0, 1.0], seed=7)
    ds["ids"] = _Ids(40)
    return ds


@pytest.fixture(scope="module")
def resume_sources(tmp_path_factory) -> dict[str, torch.utils.data.Dataset]:
    return _build_sources(tmp_path_factory.mktemp("resume_sources"))


def _loaders(dataset, gb: int, dp: int, **kw) -> list[DistributedDataLoader]:
    return [
        DistributedDataLoader(dataset, global_batch_size=gb, dp_rank=r, dp_size=dp, seed=3, **kw)
        for r in range(dp)
    ]


Row = tuple[tuple[str, tuple[int, ...]], ...]


def _rows(batch: dict[str, torch.Tensor]) -> list[Row]:
    """The batch's rows, each as (key, values) pairs of every field."""
    return [
        tuple((k, tuple(v[j].tolist())) for k, v in sorted(batch.items()))
        for j in range(len(batch["labels"]))
    ]


def _row(sample: dict[str, Any]) -> Row:
    """A dataset sample as a row of :func:`_rows`."""
    return tuple((k, tuple(torch.as_tensor(v).tolist())) for k, v in sorted(sample.items()))


def _step(loaders: list[DistributedDataLoader]) -> list[Row]:
    """The rows of one global step, in rank order (each rank's step batch holds gb / dp rows)."""
    batches = [next(ld) for ld in loaders]
    assert all(len(b["input_ids"]) == 8 // len(loaders) for b in batches)
    return [r for b in batches for r in _rows(b)]


@pytest.mark.parametrize("new_dp", [2, 1, 4])
@pytest.mark.parametrize("source", RESUME_SOURCES)
def test_resume_yields_exactly_the_unseen_samples(resume_sources, source, new_dp):
    ds, gb = resume_sources[source], 8
    n = len(ds)
    per_epoch = n // gb
    steps = per_epoch + 4  # the run crosses an epoch boundary
    reference = _loaders(ds, gb, 2)
    expected = [_step(reference) for _ in range(steps)]
    # Each epoch is a permutation of the rows (less a trailing partial batch).
    all_rows = collections.Counter(_row(ds[i]) for i in range(n))
    epoch = collections.Counter(r for s in expected[:per_epoch] for r in s)
    assert epoch.total() == per_epoch * gb and not epoch - all_rows
    if source == "ids":
        assert sorted(r[0][1][0] for s in expected[:per_epoch] for r in s) == list(range(n))

    first = _loaders(ds, gb, 2)
    seen = [_step(first) for _ in range(3)]
    state = first[0].state_dict()
    assert all(ld.state_dict() == state for ld in first)  # global, identical on all ranks
    resumed = _loaders(ds, gb, new_dp)
    for ld in resumed:
        ld.load_state_dict(state)
    rest = [_step(resumed) for _ in range(steps - 3)]
    assert seen + rest == expected


@pytest.mark.parametrize("source", RESUME_SOURCES)
def test_resume_with_worker_processes_matches(resume_sources, source):
    ds = resume_sources[source]
    ref = _loaders(ds, 4, 1)[0]
    expected = [next(ref) for _ in range(4)]
    ld = _loaders(ds, 4, 1, num_workers=1)[0]
    got = [next(ld), next(ld)]
    state = ld.state_dict()
    ld2 = _loaders(ds, 4, 1, num_workers=1)[0]
    ld2.load_state_dict(state)
    got += [next(ld2), next(ld2)]
    for a, b in zip(got, expected, strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_resume_rejects_a_different_global_order():
    ld = _loaders(_Ids(40), 8, 2)[0]
    other = _loaders(_Ids(40), 16, 2)[0]
    with pytest.raises(ValueError, match="global_batch_size=8 was saved"):
        other.load_state_dict(ld.state_dict())


def test_readers_and_memmap(tmp_path):
    (tmp_path / "d.jsonl").write_text(
        json.dumps({"text": "héllo"}) + "\n\n" + json.dumps({"text": "x"}) + "\n"
    )
    assert list(read_jsonl_texts(tmp_path / "d.jsonl")) == ["héllo", "x"]
    (tmp_path / "bad.jsonl").write_text('{"body": 1}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1: field 'text'"):
        list(read_jsonl_texts(tmp_path / "bad.jsonl"))
    tokens = np.arange(50) % 7
    write_token_file(tmp_path / "t.bin", tokens)
    mm = read_token_file(tmp_path / "t.bin")
    ds = PackedTokens(mm, 8, eos_id=6)
    ref = PackedTokens(tokens, 8, eos_id=6)
    assert len(ds) == 6
    for i in range(len(ds)):
        assert all(torch.equal(ds[i][k], ref[i][k]) for k in ref[i])
    with pytest.raises(ValueError, match="do not fit uint16"):
        write_token_file(tmp_path / "u.bin", [70000])


def test_bytes_that_are_not_utf8_are_named(tmp_path, caplog):
    good = json.dumps({"text": "ok"}).encode()
    (tmp_path / "d.jsonl").write_bytes(good + b"\n" + b'{"text": "b\xffd"}\n')
    with pytest.raises(ValueError, match=r"d.jsonl:2: not valid UTF-8 \(byte 0xff at column 12\)"):
        list(read_jsonl_texts(tmp_path / "d.jsonl"))
    # text files: replaced, with one warning per file naming it and the number of bytes
    raw = "héllo ".encode() + b"\xff\xfe x \xc3"
    (tmp_path / "t.txt").write_bytes(raw)
    (tmp_path / "u.txt").write_bytes("fine é".encode())
    plait_log = logging.getLogger("plait")  # a trainer's set-up stops it propagating: listen on it
    plait_log.addHandler(caplog.handler)
    propagate, plait_log.propagate = plait_log.propagate, False  # each record once, trainer or not
    try:
        assert read_text_file(tmp_path / "t.txt") == raw.decode("utf-8", errors="replace")
        assert read_text_file(tmp_path / "u.txt") == "fine é"
    finally:
        plait_log.removeHandler(caplog.handler)
        plait_log.propagate = propagate
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings == [f"{tmp_path / 't.txt'}: 3 byte(s) that are not UTF-8 were replaced by U+FFFD"]


def test_hf_datasets_missing_names_the_extra():
    try:
        import datasets  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match=r"plait-loop\[datasets\]"):
            next(read_hf_texts("x"))
    else:  # pragma: no cover - only without datasets
        pytest.skip("datasets is installed")


def test_byte_tokenizer_roundtrip():
    tok = ByteTokenizer()
    ids = tok.encode("añb")
    assert ids == list("añb".encode()) and tok.decode([*ids, tok.eos_id]) == "añb"


def test_hf_tokenizer_from_local_dir(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<eos>": 0, "hello": 1, "world": 2, "[UNK]": 3}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    hf = HFTokenizer(tmp_path)
    assert hf.encode("hello world zzz") == [1, 2, 3]
    assert (hf.eos_id, hf.pad_id, hf.vocab_size) == (0, 0, 4)
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json"):
        HFTokenizer(tmp_path / "missing")


# -- corpus sources: formats, bad input, tokenizers ---------------------------------------------------------
DOCS = ["first document\n", "zweites Dokument: grün", "third, with a\nsecond line"]


def _write_sources(root):
    """The same documents as text files, JSONL, parquet, an arrow (IPC) file and a save_to_disk-layout
    folder (arrow stream files listed in state.json)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    (root / "txt").mkdir()
    for i, d in enumerate(DOCS):
        (root / "txt" / f"{i}.txt").write_text(d, encoding="utf-8")
    (root / "a.jsonl").write_text(
        "".join(json.dumps({"id": i, "text": d}) + "\n" for i, d in enumerate(DOCS))
    )
    table = pa.table({"id": list(range(len(DOCS))), "text": DOCS})
    pq.write_table(table, root / "a.parquet", row_group_size=2)
    with pa.ipc.new_file(root / "a.arrow", table.schema) as w:
        w.write_table(table)
    saved = root / "saved"
    saved.mkdir()
    for i, part in enumerate([table.slice(0, 2), table.slice(2)]):
        with pa.ipc.new_stream(saved / f"data-0000{i}-of-00002.arrow", part.schema) as w:
            w.write_table(part)
    files = [{"filename": f"data-0000{i}-of-00002.arrow"} for i in range(2)]
    (saved / "state.json").write_text(json.dumps({"_data_files": files}))
    (saved / "dataset_info.json").write_text("{}")


def test_every_format_reads_the_same_documents(tmp_path):
    _write_sources(tmp_path)
    for source in ["txt", "a.jsonl", "a.parquet", "a.arrow", "saved", "txt/*.txt"]:
        files = resolve_source(str(tmp_path / source))
        assert list(read_documents(files)) == DOCS, source
    (tmp_path / "data.dat").write_text(json.dumps({"body": "x"}) + "\n")
    assert list(read_documents([tmp_path / "data.dat"], "jsonl", "body")) == ["x"]


def test_packed_corpus_is_the_documents_bytes_each_ending_in_eos(tmp_path):
    _write_sources(tmp_path)
    tok = ByteTokenizer()
    stream = [t for d in DOCS for t in [*d.encode("utf-8"), tok.eos_id]]
    ds = build_packed_corpus(resolve_source(tmp_path / "a.jsonl"), 8, tok)
    assert list(np.asarray(ds.tokens)) == stream
    write_token_file(tmp_path / "c.tokens", stream)
    ds = build_packed_corpus(resolve_source(tmp_path / "c.tokens"), 8, tok)
    assert list(np.asarray(ds.tokens)) == stream
    assert len(ds) == (len(stream) - 1) // 8
    assert ds[1]["input_ids"].tolist() == stream[8:16]


def test_several_token_files_are_memory_mapped_and_give_the_in_memory_rows(tmp_path):
    tok = ByteTokenizer()
    rng = np.random.default_rng(0)
    stream = rng.integers(0, 256, 500)
    stream[rng.choice(500, 40, replace=False)] = tok.eos_id
    cuts = [0, 1, 2, 130, 131, 340, 500]  # files of 1, 1, 128, 1, 209 and 160 tokens
    (tmp_path / "raw").mkdir()
    for k, (a, b) in enumerate(itertools.pairwise(cuts)):
        write_token_file(tmp_path / "raw" / f"{k}.tokens", stream[a:b])
    files = resolve_source(tmp_path / "raw")
    ds = build_packed_corpus(files, 7, tok, "tokens")
    assert isinstance(ds.tokens, ConcatenatedTokens) and len(ds.tokens.arrays) == 6
    assert all(isinstance(a, np.memmap) for a in ds.tokens.arrays)
    reference = PackedTokens(np.concatenate([np.fromfile(f, np.uint16) for f in files]), 7, tok.eos_id)
    assert len(ds) == len(reference) == 499 // 7
    for i in range(len(ds)):
        a, b = ds[i], reference[i]
        assert {k: v.tolist() for k, v in a.items()} == {k: v.tolist() for k, v in b.items()}, i
    for a, b in [(0, 500), (0, 0), (1, 2), (0, 3), (129, 132), (5, 499), (-10, None), (300, 1000)]:
        assert ds.tokens[a:b].tolist() == stream[a:b].tolist(), (a, b)
    assert [int(ds.tokens[i]) for i in (0, 1, 2, 130, 131, 499, -1, -500)] == [
        int(stream[i]) for i in (0, 1, 2, 130, 131, 499, -1, -500)
    ]
    assert np.asarray(ds.tokens).tolist() == stream.tolist()
    with pytest.raises(IndexError, match="index 500 is out of bounds for 500 tokens"):
        ds.tokens[500]
    with pytest.raises(TypeError, match="only unit-step slices"):
        ds.tokens[::2]


def test_hf_tokenizer_places_bos_and_eos_as_transformers_does(tmp_path):
    import transformers

    text = "hello the lazy world"
    for i, template in enumerate(["<s> $A", "$A </s>", "<s> $A </s>"]):
        path = make_tokenizer(tmp_path / f"tok{i}", template)
        tok = HFTokenizer(path)
        reference = transformers.AutoTokenizer.from_pretrained(path)(text)["input_ids"]
        assert tok.encode_document(text) == reference
        (tmp_path / f"d{i}.txt").write_text(text)
        ds = build_packed_corpus([tmp_path / f"d{i}.txt"] * 2, 4, tok)
        doc = reference if reference[-1] == tok.eos_id else [*reference, tok.eos_id]  # eos once
        assert list(np.asarray(ds.tokens)) == doc * 2
        out = tmp_path / f"export{i}"
        out.mkdir()
        copy_tokenizer_files(path, out)
        assert transformers.AutoTokenizer.from_pretrained(out)(text)["input_ids"] == reference


def _error(match, fn, *args, **kwargs):
    with pytest.raises(DataSourceError, match=match) as e:
        result = fn(*args, **kwargs)
        if not isinstance(result, list | np.ndarray):
            list(result)
    assert "\n" not in str(e.value)


def test_bad_sources_are_one_line_naming_file_and_line_or_row(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    _error("does not exist", resolve_source, tmp_path / "nowhere")
    _error("no files match", resolve_source, str(tmp_path / "*.jsonl"))
    (tmp_path / "empty.jsonl").write_text("")
    _error(r"empty\.jsonl is empty", resolve_source, tmp_path / "empty.jsonl")
    (tmp_path / "x.bin").write_bytes(b"\x00\x01")
    _error(r"x\.bin: cannot tell the format from the extension '\.bin'", read_documents, [tmp_path / "x.bin"])
    _error(r"x\.bin: a binary file", read_documents, [tmp_path / "x.bin"], "text")
    (tmp_path / "bad.txt").write_bytes(b"ok\nstill ok\nbad \xff byte\n")
    _error(r"bad\.txt:3: not valid UTF-8 \(byte 0xff\)", read_documents, [tmp_path / "bad.txt"])
    lines = {
        "notjson": b'{"text": "a"}\n{"text": \n',
        "missing": b'{"text": "a"}\n\n{"body": "b"}\n',
        "number": b'{"text": 3}\n',
        "utf8": b'{"text": "a"}\n{"text": "\xc3"}\n',
    }
    where = {
        "notjson": "2: not valid JSON",
        "missing": "3: field 'text' missing",
        "number": "1: field",
        "utf8": "2: not valid UTF-8",
    }
    for name, data in lines.items():
        (tmp_path / f"{name}.jsonl").write_bytes(data)
        _error(rf"{name}\.jsonl:{where[name]}", read_documents, [tmp_path / f"{name}.jsonl"])
    pq.write_table(pa.table({"body": ["a"]}), tmp_path / "col.parquet")
    _error(r"col\.parquet: no column 'text' \(columns: body\)", read_documents, [tmp_path / "col.parquet"])
    pq.write_table(pa.table({"text": ["a", None]}), tmp_path / "null.parquet")
    _error(r"null\.parquet: row 1: column 'text' is NoneType", read_documents, [tmp_path / "null.parquet"])
    write_token_file(tmp_path / "t.tokens", [1, 300, 2])
    _error(r"t\.tokens: token id 300 is outside the tokenizer's 259 ids", build_packed_corpus,
           [tmp_path / "t.tokens"], 1, ByteTokenizer())  # fmt: skip


def test_parquet_without_pyarrow_names_the_extra(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_pyarrow(name, *args, **kwargs):  # type: ignore[no-untyped-def]
        if name.startswith("pyarrow"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_pyarrow)
    (tmp_path / "a.parquet").write_bytes(b"PAR1")
    _error(r"pyarrow: pip install 'plait-loop\[parquet\]'", read_documents, [tmp_path / "a.parquet"])
