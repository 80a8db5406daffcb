"""A tiny Hugging Face tokenizer trained offline (BPE on a few strings), saved as ``tokenizer.json`` plus
``tokenizer_config.json`` the way ``transformers`` saves a fast tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

CORPUS = ["hello world", "the quick brown fox", "jumps over the lazy dog", "hello there, world"]


def make_tokenizer(path: Path, template: str = "<s> $A", vocab_size: int = 60) -> Path:
    """Train a BPE tokenizer on :data:`CORPUS` into directory ``path``; ``template`` is the single-text
    post-processor (where bos ``<s>`` and eos ``</s>`` go)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator(CORPUS, trainer)
    specials = [(t, tok.token_to_id(t)) for t in ("<s>", "</s>") if t in template]
    tok.post_processor = processors.TemplateProcessing(single=template, special_tokens=specials)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path
