"""The SFT examples on a tiny checkpoint with a chat tokenizer: full fine-tuning to a Hugging Face
checkpoint (model and tokenizer load in transformers), LoRA to a PEFT adapter, bad chat data stopped
before the model is built."""

from __future__ import annotations

import json
import math

import peft
import pytest
import torch
import transformers
from plait.loop.data import GlobalBatchPlan, PadCollator
from plait.models import from_pretrained
from plait.train.finetune import main as finetune
from plait.train.train import main as train
from plait.train.train import parse_args

from tests.e2e._pretrain_runner import REPO, dataset, read_metrics
from tests.loop.test_chat import _sft_chats, make_chat_tokenizer

EXAMPLES = REPO / "examples"
SFT = EXAMPLES / "sft" / "configs"
SMALL = ["--steps", "3", "--batching.seq_len=64", "--batching.global_batch_size=4", "--batching.microbatch_size=2",
         "--checkpoint.enabled=false", "--logging.progress_bar=false", "--logging.interval=1",
         "--optimizer.lr=0.01"]  # fmt: skip


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A seed checkpoint of the llama CPU config with a chat tokenizer, and a chat file."""
    root = tmp_path_factory.mktemp("sft")
    seed = root / "base"
    train(
        ["--config", str(EXAMPLES / "configs" / "llama" / "cpu.toml"), "--write-seed-checkpoint", str(seed)]
    )
    make_chat_tokenizer(seed)
    chats = root / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": m}) + "\n" for m in _sft_chats(64)))
    return seed, chats


def test_full_sft_exports_a_checkpoint_and_tokenizer_transformers_load(base, tmp_path):
    seed, chats = base
    run_dir = tmp_path / "run"
    argv = ["--config", str(SFT / "full.toml"), "--init-from", str(seed), "--run-dir", str(run_dir),
            f"--data.source={chats}", *SMALL]  # fmt: skip
    config, _ = parse_args(argv)
    assert config.data.tokenizer == str(seed) and config.data.format == "chat"
    ds = dataset(config.data, 64)
    metrics = train(argv)
    assert math.isfinite(metrics["loss"])
    # step 1's loss is the seed model's cross-entropy over the assistant targets of the first global batch
    batch = PadCollator()([ds[i] for i in GlobalBatchPlan(len(ds), 4, seed=config.run.seed).global_batch(0)])
    labels = batch.pop("labels")
    assert 0 < int((labels != -100).sum()) < labels.numel() // 3  # answers only: prompts are masked
    with torch.no_grad():
        logits = from_pretrained(seed).eval()(**batch)["logits"]
    want = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    assert read_metrics(run_dir)[0]["loss"] == pytest.approx(float(want), rel=1e-4)
    hf = transformers.AutoModelForCausalLM.from_pretrained(run_dir / "hf").eval()
    tok = transformers.AutoTokenizer.from_pretrained(run_dir / "hf")
    ids = tok.apply_chat_template(_sft_chats(1, seed=5)[0], tokenize=True, return_dict=True)["input_ids"]
    ids = torch.tensor([list(ids)])
    ours = from_pretrained(run_dir / "hf").eval()
    with torch.no_grad():
        torch.testing.assert_close(ours(input_ids=ids)["logits"], hf(ids).logits, atol=2e-5, rtol=1e-4)
        moved = transformers.AutoModelForCausalLM.from_pretrained(seed)(ids).logits
    assert not torch.allclose(moved, hf(ids).logits, atol=1e-4), "training must have moved the weights"


def test_lora_sft_exports_an_adapter_peft_loads(base, tmp_path):
    seed, chats = base
    adapter = finetune(["--config", str(SFT / "lora.toml"), "--base", str(seed), "--run-dir",
                                  str(tmp_path / "lora"), f"--data.source={chats}", *SMALL])  # fmt: skip
    assert (adapter / "adapter_model.safetensors").is_file() and (adapter / "tokenizer.json").is_file()
    tok = transformers.AutoTokenizer.from_pretrained(adapter)
    ids = tok.apply_chat_template(_sft_chats(1, seed=5)[0], tokenize=True, return_dict=True)["input_ids"]
    ids = torch.tensor([list(ids)])
    model = transformers.AutoModelForCausalLM.from_pretrained(seed, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        before = model(ids).logits
        after = peft.PeftModel.from_pretrained(model, str(adapter)).eval()(ids).logits
    assert not torch.allclose(before, after, atol=1e-4), "training must have moved the adapters"


def test_bad_chat_data_stops_before_the_model(base, tmp_path, monkeypatch, capsys):
    seed, _ = base

    def no_model(*a, **k):  # type: ignore[no-untyped-def]
        raise AssertionError("the model was built before the error was reported")

    import plait.train.job

    monkeypatch.setattr(plait.train.job, "CausalLMProvider", no_model)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": _sft_chats(1)[0]}) + "\n" + json.dumps({"messages": [
        {"role": "user", "content": "hi"}, {"role": "bot", "content": "x"}]}) + "\n")  # fmt: skip
    argv = ["--config", str(SFT / "full.toml"), "--init-from", str(seed), "--run-dir", str(tmp_path / "r"),
            f"--data.source={bad}", *SMALL]  # fmt: skip
    for extra, want in (
        ([], f"{bad}:2: message 1 has role 'bot'"),
        (["--data.tokenizer=bytes"], "data.format='chat' needs data.tokenizer"),
    ):
        with pytest.raises(SystemExit) as exc:
            train([*argv, *extra])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and want in err and err.count("\n") == 1, err
