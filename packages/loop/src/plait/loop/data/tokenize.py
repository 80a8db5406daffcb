"""Tokenize a corpus once, with worker processes, into a memory-mappable token file and a document index.

``python -m plait.loop.data tokenize --tokenizer DIR --output OUT INPUT...`` writes to ``OUT``:

- ``corpus.tokens``: every document's ids (with the tokenizer's special tokens, ending in eos, as
  :func:`~plait.loop.data.build_packed_corpus` encodes them), raw ``uint16`` (vocabularies up to 65536
  ids) or ``uint32``;
- ``documents.npy``: the documents' start offsets in ``corpus.tokens`` (int64);
- ``assistant_mask.npy``: with ``--format chat``, 1 for each assistant token (uint8), and the
  conversations are encoded with the chat template as :func:`~plait.loop.data.encode_chat` does (a
  conversation that renders no assistant token is refused, as the ``chat`` format refuses it with
  ``loss_on="assistant"``);
- ``meta.json``: the dtype, vocabulary size, eos id, token and document counts, the inputs.

The ``tokens`` format reads ``OUT`` (as a source) memory-mapped, with the document boundaries of the
index (and, for conversations with ``loss_on="assistant"``, their assistant masks).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import multiprocessing as mp
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

__all__ = ["DOCUMENTS_FILE", "MASK_FILE", "META_FILE", "TOKENS_FILE", "is_tokenized_dir", "tokenize_corpus"]

TOKENS_FILE = "corpus.tokens"
DOCUMENTS_FILE = "documents.npy"
META_FILE = "meta.json"
MASK_FILE = "assistant_mask.npy"


def is_tokenized_dir(path: Path) -> bool:
    """Whether ``path`` is an output directory of :func:`tokenize_corpus`."""
    return path.is_dir() and (path / META_FILE).is_file() and (path / TOKENS_FILE).is_file()


@functools.lru_cache(maxsize=1)
def _tokenizer(path: str) -> Any:
    """The worker's tokenizer (loaded once per process): ``"bytes"`` or a directory with ``tokenizer.json``."""
    from plait.loop.data.tokenizers import ByteTokenizer, HFTokenizer

    return ByteTokenizer() if path == "bytes" else HFTokenizer(path)


@functools.lru_cache(maxsize=1)
def _chat_template(path: str) -> Any:
    from plait.loop.data.sources import chat_template_of

    return chat_template_of(_tokenizer(path))


def _encode_batch(path: str, items: Sequence[Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """A batch of documents' ids (each with its special tokens, ending in eos), their lengths and, for
    conversations (``(where, messages)`` items), their assistant-token masks."""
    from plait.loop.data.sources import NO_ASSISTANT_TOKEN, DataSourceError, _encode_document, encode_chat

    tok = _tokenizer(path)
    masks: list[list[int]] | None = None
    if items and isinstance(items[0], tuple):
        docs, masks = [], []
        for where, messages in items:
            try:
                ids, mask = encode_chat(tok, _chat_template(path), messages)
            except ValueError as e:
                raise DataSourceError(f"{where}: {e}") from None
            if not any(mask):
                raise DataSourceError(f"{where}: {NO_ASSISTANT_TOKEN}")
            docs.append(ids)
            masks.append(mask)
    else:
        docs = [_encode_document(tok, t) for t in items]
    flat = np.fromiter(itertools.chain.from_iterable(docs), np.int64)
    mask_flat = None if masks is None else np.fromiter(itertools.chain.from_iterable(masks), np.uint8)
    return flat, np.asarray([len(d) for d in docs]), mask_flat


def _batches(texts: Iterable[Any], size: int) -> Iterator[list[Any]]:
    it = iter(texts)
    while batch := list(itertools.islice(it, size)):
        yield batch


def tokenize_corpus(
    inputs: Sequence[str | Path],
    tokenizer: str | Path,
    output: str | Path,
    *,
    fmt: str = "auto",
    text_field: str = "text",
    workers: int | None = None,
    batch_size: int = 256,
    progress: bool = True,
) -> dict[str, Any]:
    """Tokenize the documents of ``inputs`` (files, directories or globs, read as
    :func:`~plait.loop.data.read_documents` reads them) with the Hugging Face tokenizer of directory
    ``tokenizer`` (or ``"bytes"``, the byte tokenizer that training uses by default) into ``output`` (see the module docstring); returns the ``meta.json`` record.

    The main process reads the documents and writes the tokens in order; ``workers`` processes (default:
    the CPU count) encode batches of ``batch_size`` documents. A progress bar counts documents and tokens.

    Raises:
        DataSourceError: bad input (naming the file and line or row), or a tokenizer directory without
            ``tokenizer.json``.
    """
    from plait.loop.data.formats import AUTO, data_format
    from plait.loop.data.sources import (
        DataSourceError,
        read_chats,
        read_documents,
        resolve_source,
        token_dtype,
    )

    try:
        tok = _tokenizer(str(tokenizer))
    except (FileNotFoundError, ValueError, ImportError) as e:
        raise DataSourceError(f"--tokenizer: {e}") from None
    files = [f for src in inputs for f in resolve_source(src)]
    dtype = np.dtype(token_dtype(tok.vocab_size))
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".{TOKENS_FILE}.partial"
    starts: list[np.ndarray] = []
    total = 0
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    workers = workers or os.cpu_count() or 1
    encode = functools.partial(_encode_batch, str(tokenizer))
    chats = fmt != AUTO and data_format(fmt).holds == "chats"
    if chats:
        _chat_template(str(tokenizer))  # no template: fail before any work
        docs: Iterable[Any] = read_chats(files)
    else:
        docs = read_documents(files, fmt, text_field)
    batches = _batches(docs, batch_size)
    masks: list[np.ndarray] = []
    bar = tqdm(desc="tokenize", unit=" docs", disable=not progress)
    try:
        with open(tmp, "wb") as f, ctx.Pool(workers) if workers > 1 else contextlib.nullcontext() as pool:
            results = pool.imap(encode, batches) if pool is not None else map(encode, batches)
            for ids, lengths, mask in results:
                ids.astype(dtype).tofile(f)
                if mask is not None:
                    masks.append(mask)
                starts.append(total + np.concatenate([[0], np.cumsum(lengths)[:-1]]))
                total += int(lengths.sum())
                bar.update(len(lengths))
                bar.set_postfix(tokens=total, refresh=False)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        bar.close()
    if total == 0:
        tmp.unlink(missing_ok=True)
        raise DataSourceError(f"the inputs hold no documents: {', '.join(map(str, files))}")
    offsets = np.concatenate(starts).astype(np.int64)
    np.save(out / DOCUMENTS_FILE, offsets)
    if chats:
        np.save(out / MASK_FILE, np.concatenate(masks))
    else:
        (out / MASK_FILE).unlink(missing_ok=True)
    os.replace(tmp, out / TOKENS_FILE)
    meta = {
        "dtype": dtype.name,
        "vocab_size": tok.vocab_size,
        "eos_id": tok.eos_id,
        "num_tokens": total,
        "num_documents": len(offsets),
        "format": "chat" if chats else "documents",
        "tokenizer": str(tokenizer),
        "inputs": [str(f) for f in files],
    }
    (out / META_FILE).write_text(json.dumps(meta, indent=1))
    return meta
