"""Tokenizers: a built-in byte-level one, and Hugging Face tokenizers from a local directory."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Protocol, runtime_checkable

__all__ = [
    "TOKENIZER_FILES",
    "ByteTokenizer",
    "HFTokenizer",
    "Tokenizer",
    "copy_tokenizer_files",
    "has_tokenizer",
]


@runtime_checkable
class Tokenizer(Protocol):
    """What the data pipeline needs from a tokenizer."""

    vocab_size: int
    eos_id: int
    pad_id: int

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added)."""
        ...

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids``."""
        ...


class ByteTokenizer:
    """UTF-8 bytes as tokens 0-255, plus ``bos`` = 256, ``eos`` = 257, ``pad`` = 258 (vocab 259).

    Needs no files, so it works for any corpus on any machine.
    """

    bos_id = 256
    eos_id = 257
    pad_id = 258
    vocab_size = 259

    def encode(self, text: str) -> list[int]:
        """UTF-8 bytes of ``text``."""
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        """Text of the byte tokens in ``ids`` (special tokens dropped, bad UTF-8 replaced)."""
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face *fast* tokenizer from a local directory holding ``tokenizer.json``.

    Uses the ``tokenizers`` library directly (plait.loop does not import transformers); special
    tokens are read from ``tokenizer_config.json`` when present.

    Args:
        path: directory with ``tokenizer.json`` (or the file itself).
        eos_token: overrides the eos token's text.
        pad_token: overrides the pad token's text (defaults to eos).

    Raises:
        ImportError: without the ``tokenizers`` package.
        FileNotFoundError: when ``tokenizer.json`` is missing.
    """

    def __init__(self, path: str | Path, eos_token: str | None = None, pad_token: str | None = None) -> None:
        try:
            from tokenizers import Tokenizer as _Tok
        except ImportError as e:
            raise ImportError("HFTokenizer needs the 'tokenizers' package: pip install tokenizers") from e
        path = Path(path)
        file = path if path.is_file() else path / "tokenizer.json"
        if not file.exists():
            raise FileNotFoundError(f"HFTokenizer: {file} not found (a fast tokenizer's tokenizer.json)")
        self._tok = _Tok.from_file(str(file))
        self.path = file.parent
        cfg_file = file.parent / "tokenizer_config.json"
        cfg = json.loads(cfg_file.read_text()) if cfg_file.exists() else {}

        def _text(v: object) -> str | None:
            return v.get("content") if isinstance(v, dict) else v  # type: ignore[return-value]

        eos = eos_token or _text(cfg.get("eos_token"))
        pad = pad_token or _text(cfg.get("pad_token")) or eos
        if eos is None:
            raise ValueError(f"HFTokenizer: no eos token in {cfg_file}; pass eos_token=")
        eos_id = self._tok.token_to_id(eos)
        if eos_id is None:
            raise ValueError(f"HFTokenizer: eos token {eos!r} is not in the vocabulary of {file}")
        pad_id = self._tok.token_to_id(pad) if pad is not None else None
        self.eos_id = int(eos_id)
        self.pad_id = int(pad_id) if pad_id is not None else self.eos_id
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` without special tokens."""
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def encode_document(self, text: str) -> list[int]:
        """Token ids of ``text`` with the special tokens the tokenizer's post-processor places (e.g. a
        leading bos), as ``transformers`` encodes it by default."""
        return list(self._tok.encode(text, add_special_tokens=True).ids)

    def encode_with_char_map(self, text: str) -> tuple[list[int], Callable[[int], int | None]]:
        """Token ids of ``text`` without special tokens, and the map from a character index to the
        index of the token that covers it (None for characters no token covers, e.g. dropped spaces)."""
        enc = self._tok.encode(text, add_special_tokens=False)
        return list(enc.ids), enc.char_to_token

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids``."""
        return str(self._tok.decode(ids))


TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
)


def has_tokenizer(path: str | Path) -> bool:
    """Whether directory ``path`` holds a fast tokenizer (``tokenizer.json``)."""
    return (Path(path) / "tokenizer.json").is_file()


def copy_tokenizer_files(src: str | Path, dst: str | Path) -> list[Path]:
    """Copy a tokenizer's files (:data:`TOKENIZER_FILES` that exist) from directory ``src`` to ``dst``,
    so that ``transformers.AutoTokenizer.from_pretrained(dst)`` loads it; returns the copies."""
    out = []
    for name in TOKENIZER_FILES:
        if (Path(src) / name).is_file():
            out.append(Path(shutil.copy2(Path(src) / name, Path(dst) / name)))
    return out
