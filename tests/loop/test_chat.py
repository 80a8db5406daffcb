"""Chat data: token ids and assistant masks against transformers' ``apply_chat_template``, packing with
prompt masking, bad records, and a short SFT run that learns the answers only when the prompts are out
of the loss."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from plait.loop.data import (
    ByteTokenizer,
    ChatTemplate,
    DataSourceError,
    HFTokenizer,
    build_packed_corpus,
    encode_chat,
)

from tests.loop._tiny_tokenizer import make_tokenizer

# trim_blocks / lstrip_blocks matter: the block tags' own newlines and indentation are dropped
TEMPLATE = """{{ bos_token }}
{% for m in messages %}
    {% if m['role'] not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('unsupported role ' + m['role']) }}
    {% endif %}
    {% if m['role'] == 'assistant' %}
<|assistant|>
{% generation %}{% if m.reasoning_content is defined %}{{ m.reasoning_content }} {% endif %}{{ m['content'] }}{{ eos_token }}{% endgeneration %}
    {% else %}
<|{{ m['role'] }}|>
{{ m['content'] }}
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
<|assistant|>
{% endif %}"""
# the same text without the generation block: the assistant spans come from prefix renders
PLAIN = TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}\n    ", "")
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>"]

CHATS = [
    [{"role": "user", "content": "hello world"}, {"role": "assistant", "content": "the quick brown fox"}],
    [
        {"role": "system", "content": "the lazy dog"},
        {"role": "user", "content": "hello there, world"},
        {"role": "assistant", "content": "jumps over"},
        {"role": "user", "content": "the fox?"},
        {"role": "assistant", "content": "hello  world "},
    ],
    [{"role": "assistant", "content": ""}, {"role": "user", "content": "over"}],
    [{"role": "user", "content": "dog"}, {"role": "assistant", "content": "fox", "thinking": "the lazy"}],
]


def make_chat_tokenizer(path: Path, template: str = TEMPLATE) -> Path:
    """The tiny BPE tokenizer with role tokens and ``template`` in ``tokenizer_config.json``."""
    from tokenizers import AddedToken, Tokenizer

    make_tokenizer(path)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True) for t in ROLE_TOKENS])
    tok.save(str(path / "tokenizer.json"))
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    return path


@pytest.mark.parametrize("template", [TEMPLATE, PLAIN], ids=["generation-block", "prefix-renders"])
def test_ids_and_assistant_mask_equal_transformers(tmp_path, template):
    ours = HFTokenizer(make_chat_tokenizer(tmp_path / "tok", template))
    reference = make_chat_tokenizer(tmp_path / "ref", TEMPLATE)  # transformers needs the generation block
    theirs = transformers.AutoTokenizer.from_pretrained(reference)
    chat = ChatTemplate.from_dir(ours.path)
    assert chat.has_generation_block == (template == TEMPLATE)
    for messages in CHATS:
        want = theirs.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        ids, mask = encode_chat(ours, chat, messages)
        assert ids == list(want["input_ids"])
        assert mask == list(want["assistant_masks"])
        assert any(mask) or messages[0]["content"] == ""
        assert chat.render(messages) == theirs.apply_chat_template(messages, tokenize=False)
        assert chat.render(messages, add_generation_prompt=True) == theirs.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )


def _write_chats(path: Path, chats: list[list[dict[str, str]]]) -> Path:
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in chats))
    return path


def test_packed_chats_keep_documents_and_train_on_assistant_tokens_only(tmp_path):
    tok = HFTokenizer(make_chat_tokenizer(tmp_path / "tok"))
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "tok")
    files = [_write_chats(tmp_path / "c.jsonl", CHATS[:2] * 3)]
    stream, target, starts = [], [], []
    for m in CHATS[:2] * 3:
        enc = theirs.apply_chat_template(
            m, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        starts.append(len(stream))
        stream += list(enc["input_ids"])
        target += list(enc["assistant_masks"])
    seq_len = 16
    for loss_on in ("assistant", "all"):
        ds = build_packed_corpus(files, seq_len, tok, "chat", loss_on=loss_on)  # type: ignore[arg-type]
        assert len(ds) == (len(stream) - 1) // seq_len
        for i in range(len(ds)):
            s = ds[i]
            lo = i * seq_len
            assert s["input_ids"].tolist() == stream[lo : lo + seq_len]
            doc = [sum(st <= p for st in starts) - 1 for p in range(lo, lo + seq_len + 1)]
            first = doc[0]
            assert s["document_ids"].tolist() == [d - first for d in doc[:-1]]  # eos inside a chat: no cut
            want = [
                stream[p + 1]
                if doc[p - lo + 1] == doc[p - lo] and (loss_on == "all" or target[p + 1])
                else -100
                for p in range(lo, lo + seq_len)
            ]
            assert s["labels"].tolist() == want


def test_parquet_and_arrow_messages_columns_read_as_jsonl(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    tok = HFTokenizer(make_chat_tokenizer(tmp_path / "tok"))
    chats = CHATS[:2] * 3
    want = build_packed_corpus([_write_chats(tmp_path / "c.jsonl", chats)], 8, tok, "chat")
    table = pa.table({"id": list(range(len(chats))), "messages": chats})
    pq.write_table(table, tmp_path / "c.parquet")
    with pa.ipc.new_stream(tmp_path / "c.arrow", table.schema) as writer:  # as datasets.save_to_disk writes
        writer.write_table(table)
    for name in ("c.parquet", "c.arrow"):
        got = build_packed_corpus([tmp_path / name], 8, tok, "chat")
        assert np.array_equal(got.tokens, want.tokens) and np.array_equal(got.loss_mask, want.loss_mask)
    pq.write_table(pa.table({"messages": [[{"role": "user", "content": "x"}]]}), tmp_path / "bad.parquet")
    with pytest.raises(DataSourceError, match=r"bad.parquet: row 0: no assistant message"):
        build_packed_corpus([tmp_path / "bad.parquet"], 8, tok, "chat")


def test_bad_chat_records_name_file_and_line(tmp_path):
    tok = HFTokenizer(make_chat_tokenizer(tmp_path / "tok"))
    ok = json.dumps({"messages": CHATS[0]})

    def fails(lines: list[str], match: str, tokenizer=tok) -> None:
        path = tmp_path / "bad.jsonl"
        path.write_text("\n".join(lines) + "\n")
        with pytest.raises(DataSourceError) as e:
            build_packed_corpus([path], 8, tokenizer, "chat")
        assert str(e.value).count("\n") == 0
        assert match in str(e.value), str(e.value)

    bad = tmp_path / "bad.jsonl"
    fails([ok, json.dumps({"text": "x"})], f"{bad}:2: no 'messages' list")
    fails([ok, ok, json.dumps({"messages": [{"role": "bot", "content": "x"}]})],
          f"{bad}:3: message 0 has role 'bot' (expected one of system, user, assistant, tool)")  # fmt: skip
    fails([json.dumps({"messages": [{"role": "user", "content": "x"}]})], f"{bad}:1: no assistant message")
    fails(
        [json.dumps({"messages": [{"role": "user"}, CHATS[0][1]]})],
        f"{bad}:1: message 0 (user) has no string",
    )
    fails([ok, "{not json"], f"{bad}:2: not valid JSON")
    fails([json.dumps({"messages": [{"role": "tool", "content": "x"}, CHATS[0][1]]})],
          f"{bad}:1: the chat template failed: unsupported role tool")  # fmt: skip
    fails([ok], "data.format='chat' needs data.tokenizer", ByteTokenizer())
    plain = make_tokenizer(tmp_path / "plain")
    fails([ok], f"data.tokenizer: {plain} has no chat template", HFTokenizer(plain))


def test_fully_masked_microbatch_has_zero_loss_and_gradient():
    """A microbatch whose labels are all ignored adds nothing (no NaN) to the loss or the gradient."""
    from plait.loop import CausalLMTask

    task = CausalLMTask()
    logits = torch.randn(2, 5, 11, requires_grad=True)
    batch = {"labels": torch.full((2, 5), -100)}
    out = task.loss({"logits": logits}, batch)
    assert task.num_loss_tokens(batch) == 0 and float(out.objective.detach()) == 0.0
    out.objective.backward()
    assert logits.grad is not None and torch.equal(logits.grad, torch.zeros_like(logits))


@pytest.fixture
def one_thread():
    """One intra-op thread: a tiny model on a shared CPU is many times faster without thread contention."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_a_fully_masked_microbatch_in_a_training_step_adds_nothing(tmp_path, one_thread):
    """Through the trainer's step (4 microbatches of 2 rows): the first microbatch's labels all ignored,
    the gradient is finite and equals float64 PyTorch's over the global batch's remaining labels."""
    import copy

    from tests.loop.test_trainer import _config, _trainer

    tr = _trainer(_config(tmp_path))
    batch = next(tr.data_loader)
    batch["labels"][:2] = -100
    stats, tokens, _ = tr.forward_backward(batch)
    assert tokens == int((batch["labels"] != -100).sum()) and torch.isfinite(stats.loss_sum)
    ref = copy.deepcopy(tr.model_parts[0]).double()
    ref.zero_grad(set_to_none=True)
    logits = ref(batch["input_ids"])["logits"]
    torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100
    ).backward()
    for name, p in tr.model_parts[0].named_parameters():
        assert torch.isfinite(p.grad).all()
        torch.testing.assert_close(
            p.grad.double(), dict(ref.named_parameters())[name].grad, rtol=1e-4, atol=1e-6
        )
    tr.close()


# -- a short SFT run --------------------------------------------------------------------------------
WORDS = ["hello", "world", "the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog"]


def _sft_chats(n: int, seed: int = 0) -> list[list[dict[str, str]]]:
    """Prompts of six random words; the answer is always the same."""
    rng = random.Random(seed)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(6)) for _ in range(n)]
    return [[{"role": "user", "content": p}, {"role": "assistant", "content": "over"}] for p in prompts]


def _train(ds, steps: int) -> float:
    """Train a tiny causal LM (next token from the current and the previous token) on every row of
    ``ds`` at once; the final loss of plait's :class:`CausalLMTask` (mean over the loss tokens)."""
    from plait.loop import CausalLMTask

    torch.manual_seed(0)
    vocab, dim = 64, 32
    rows = [ds[i] for i in range(len(ds))]
    batch = {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
    ids = batch["input_ids"]
    prev = torch.cat([torch.zeros_like(ids[:, :1]), ids[:, :-1]], 1)
    emb = torch.nn.Embedding(vocab, dim)
    mlp = torch.nn.Sequential(torch.nn.Linear(2 * dim, 64), torch.nn.GELU(), torch.nn.Linear(64, vocab))
    opt = torch.optim.Adam([*emb.parameters(), *mlp.parameters()], lr=1e-2)
    task = CausalLMTask()
    for _ in range(steps):
        out = task.loss({"logits": mlp(torch.cat([emb(ids), emb(prev)], -1))}, batch)
        loss = out.objective / out.num_tokens
        opt.zero_grad()
        loss.backward()
        opt.step()
    return float(loss.detach())


def test_sft_learns_the_answers_only_with_prompts_out_of_the_loss(tmp_path, one_thread):
    """Random prompts, a fixed answer: the assistant-token loss goes to ~0; with the prompts in the loss
    (``loss_on="all"``) it cannot (random words stay unpredictable)."""
    tok = HFTokenizer(make_chat_tokenizer(tmp_path / "tok"))
    files = [_write_chats(tmp_path / "sft.jsonl", _sft_chats(64))]
    assistant = _train(build_packed_corpus(files, 32, tok, "chat"), 60)
    everything = _train(build_packed_corpus(files, 32, tok, "chat", loss_on="all"), 60)
    assert assistant < 0.02, assistant
    assert everything > 0.5, everything  # measured 0.93: random prompt words
