"""Corpus sources: a file, a directory or a glob of text, JSONL, parquet, arrow or token files, read as documents.

Every problem with the input (a path that does not exist, an empty source, a file of unknown kind, a
line that is not JSON or not UTF-8, a missing field or column) raises :class:`DataSourceError`, one
line naming the file and the line or row.
"""

from __future__ import annotations

import glob
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
from plait.loop.data.chat import ChatTemplate, assistant_token_mask, check_messages
from plait.loop.data.formats import (
    AUTO,
    DataFormat,
    DataFormatSpec,
    DataSourceError,
    ReadOptions,
    data_format,
    data_formats,
    format_of_extension,
    register_format,
)
from plait.loop.data.packing import PackedTokens, pack_documents
from plait.loop.data.readers import (
    ConcatenatedTokens,
    read_jsonl_records,
    read_jsonl_texts,
    read_text_file,
    read_token_file,
)
from plait.loop.data.tokenize import DOCUMENTS_FILE, MASK_FILE, META_FILE, TOKENS_FILE, is_tokenized_dir
from plait.loop.data.tokenizers import Tokenizer

__all__ = [
    "DataFormat",
    "DataSourceError",
    "DocumentHoldout",
    "LossOn",
    "build_packed_corpus",
    "build_packed_splits",
    "chat_template_of",
    "encode_chat",
    "infer_format",
    "read_chats",
    "read_documents",
    "resolve_source",
    "token_dtype",
]

LossOn = Literal["assistant", "all"]
NO_ASSISTANT_TOKEN = "the chat template renders no assistant token for this record"


def _is_saved_dataset(path: Path) -> bool:
    """A ``datasets`` ``save_to_disk`` folder (``state.json`` and arrow files)."""
    return path.is_dir() and (path / "state.json").is_file() and any(path.glob("*.arrow"))


def _saved_dataset_files(path: Path) -> list[Path]:
    """The arrow files of a ``save_to_disk`` folder, in the order its ``state.json`` lists them."""
    state = json.loads((path / "state.json").read_text())
    names = [f["filename"] for f in state.get("_data_files", [])]
    return [path / n for n in names] if names else sorted(path.glob("*.arrow"))


def resolve_source(source: str | Path, pattern: str = "*") -> list[Path]:
    """The files of ``source``: one file, a directory's files matching ``pattern`` (recursively, sorted;
    a ``datasets.save_to_disk`` folder gives its arrow files in order), or the files matching a glob.
    Hidden files (``.name``) of a directory are left out.

    Raises:
        DataSourceError: the source does not exist or holds no (non-empty) files.
    """
    text = str(source)
    path = Path(text)
    if path.is_file():
        files = [path]
    elif is_tokenized_dir(path):
        files = [path / TOKENS_FILE]
    elif _is_saved_dataset(path):
        files = _saved_dataset_files(path)
    elif path.is_dir():
        files = sorted(p for p in path.rglob(pattern) if p.is_file() and not p.name.startswith("."))
        if not files:
            raise DataSourceError(f"data.source: no files matching {pattern!r} under {path}")
    elif glob.has_magic(text):
        files = sorted(Path(p) for p in glob.glob(text, recursive=True) if Path(p).is_file())
        if not files:
            raise DataSourceError(f"data.source: no files match {text}")
    else:
        raise DataSourceError(f"data.source: {path} does not exist")
    if all(p.stat().st_size == 0 for p in files):
        raise DataSourceError(f"data.source: {files[0] if len(files) == 1 else text} is empty")
    return files


def infer_format(path: Path) -> str:
    """The format of ``path`` from its extension.

    Raises:
        DataSourceError: an unknown extension (binary or not), naming the file and the choices.
    """
    spec = format_of_extension(path.suffix)
    if spec is None:
        raise DataSourceError(
            f"{path}: cannot tell the format from the extension {path.suffix or '(none)'!r}; "
            f"set data.format to one of {', '.join(data_formats())}"
        )
    return spec.name


def _format_of(path: Path, fmt: str) -> DataFormatSpec:
    """The format that reads ``path`` under ``data.format = fmt``."""
    return data_format(infer_format(path) if fmt == AUTO else fmt)


def _read_text_strict(path: Path) -> str:
    data = path.read_bytes()
    if b"\x00" in data:
        raise DataSourceError(f"{path}: a binary file (NUL bytes), not text")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise DataSourceError(f"{path}:{line}: not valid UTF-8 (byte 0x{data[e.start]:02x})") from None


def _pyarrow() -> Any:
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError:
        raise DataSourceError(
            "the parquet and arrow formats need pyarrow: pip install 'plait-loop[parquet]'"
        ) from None
    return pyarrow


def _column_values(
    path: Path, batches: Any, names: Sequence[str], field: str, text: bool = True
) -> Iterator[Any]:
    """The ``field`` column's values, row by row (strings only, with ``text``)."""
    if field not in names:
        raise DataSourceError(f"{path}: no column {field!r} (columns: {', '.join(names)})")
    row = 0
    for batch in batches:
        for value in batch.column(field).to_pylist():
            if text and not isinstance(value, str):
                raise DataSourceError(
                    f"{path}: row {row}: column {field!r} is {type(value).__name__}, not a string"
                )
            yield value
            row += 1


def _read_parquet(path: Path, field: str, text: bool = True) -> Iterator[Any]:
    pa = _pyarrow()
    try:
        pf = pa.parquet.ParquetFile(path)
    except pa.ArrowException as e:
        raise DataSourceError(f"{path}: not a parquet file: {e}") from None
    names = pf.schema_arrow.names
    batches = pf.iter_batches(columns=[field] if field in names else None)
    yield from _column_values(path, batches, names, field, text)


def _read_arrow(path: Path, field: str, text: bool = True) -> Iterator[Any]:
    pa = _pyarrow()
    try:  # datasets writes the IPC stream format; plain arrow files use the file format
        reader = pa.ipc.open_stream(path)
        batches: Any = reader
    except pa.ArrowInvalid:
        try:
            reader = pa.ipc.open_file(path)
        except pa.ArrowInvalid as e:
            raise DataSourceError(f"{path}: not an arrow file: {e}") from None
        batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
    yield from _column_values(path, batches, reader.schema.names, field, text)


def _read_jsonl(path: Path, field: str) -> Iterator[str]:
    try:
        yield from read_jsonl_texts(path, field)
    except ValueError as e:
        raise DataSourceError(str(e)) from None


def _text_document(path: Path, options: ReadOptions) -> Iterator[str]:
    yield _read_text_strict(path) if options.strict_utf8 else read_text_file(path)


_TEXT_FIELD = ("text_field",)
register_format(
    DataFormatSpec(
        "text",
        (".txt", ".text", ".md", ".rst", ".py"),
        read_documents=_text_document,
        description="a text file is one document",
    )
)
register_format(
    DataFormatSpec(
        "jsonl",
        (".jsonl", ".ndjson"),
        read_documents=lambda path, o: _read_jsonl(path, o.text_field),
        fields=_TEXT_FIELD,
        description="JSON lines, each line's text_field one document",
    )
)
register_format(
    DataFormatSpec(
        "parquet",
        (".parquet",),
        read_documents=lambda path, o: _read_parquet(path, o.text_field),
        read_column=lambda path, column: _read_parquet(path, column, text=False),
        fields=_TEXT_FIELD,
        description="parquet, each row's text_field column one document",
    )
)
register_format(
    DataFormatSpec(
        "arrow",
        (".arrow",),
        read_documents=lambda path, o: _read_arrow(path, o.text_field),
        read_column=lambda path, column: _read_arrow(path, column, text=False),
        fields=_TEXT_FIELD,
        description="arrow (a datasets.save_to_disk folder is arrow), each row's text_field column one document",
    )
)
register_format(DataFormatSpec("tokens", (".tokens",), holds="tokens", description="raw token files"))
register_format(
    DataFormatSpec(
        "chat",
        holds="chats",
        fields=("loss_on",),
        description="JSONL records (or parquet / arrow rows) with a 'messages' list, rendered with the "
        "tokenizer's chat template",
    )
)


def read_documents(
    files: Sequence[Path], fmt: str = "auto", text_field: str = "text", *, strict_utf8: bool = True
) -> Iterator[str]:
    """The documents (texts) of ``files`` in order: a text file is one document; a JSONL line, a
    parquet or arrow row is one (its ``text_field``).

    With ``strict_utf8=False`` a text file's bytes that are not UTF-8 become U+FFFD (with a warning,
    :func:`read_text_file`) instead of an error.

    Raises:
        DataSourceError: naming the file and line/row of bad input (see the module docstring).
    """
    options = ReadOptions(text_field, strict_utf8)
    for path in files:
        spec = _format_of(path, fmt)
        if spec.read_documents is None:
            what = "conversations" if spec.holds == "chats" else spec.holds
            raise DataSourceError(f"{path}: format {spec.name!r} holds {what}, not documents")
        yield from spec.read_documents(path, options)


def _chat_records(path: Path) -> Iterator[tuple[str, Any]]:
    """``(file:line or file: row N, record)`` of a chat file: JSON lines, or the ``messages`` column of
    a parquet or arrow file (``.parquet`` / ``.arrow``, e.g. a ``datasets.save_to_disk`` folder's)."""
    table = format_of_extension(path.suffix)
    if table is not None and table.read_column is not None:
        for row, messages in enumerate(table.read_column(path, "messages")):
            yield f"{path}: row {row}", {"messages": messages}
        return
    try:
        for lineno, record in read_jsonl_records(path):
            yield f"{path}:{lineno}", record
    except ValueError as e:
        raise DataSourceError(str(e)) from None


def read_chats(files: Sequence[Path]) -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """``(where, messages)`` of each record of chat files: JSON lines ``{"messages": [{"role",
    "content"}, ...]}``, or parquet / arrow files with a ``messages`` column of such lists; roles among
    :data:`~plait.loop.data.chat.ROLES`, at least one assistant turn.

    Raises:
        DataSourceError: naming the file and line (or row) of a record that is not UTF-8, not JSON, has no
            ``messages`` list, a message with an unknown role or no content, or no assistant turn.
    """
    for path in files:
        for where, record in _chat_records(path):
            try:
                yield where, check_messages(record)
            except ValueError as e:
                raise DataSourceError(f"{where}: {e}") from None


def chat_template_of(tokenizer: Tokenizer) -> ChatTemplate:
    """The chat template of a Hugging Face tokenizer's directory.

    Raises:
        DataSourceError: the byte tokenizer (it has none), a directory without a template, jinja2 missing.
    """
    path = getattr(tokenizer, "path", None)
    if path is None or not hasattr(tokenizer, "encode_with_char_map"):
        raise DataSourceError(
            "data.format='chat' needs data.tokenizer = a Hugging Face tokenizer directory with a chat template "
            "(the byte tokenizer has none)"
        )
    try:
        return ChatTemplate.from_dir(path)
    except (ImportError, ValueError) as e:
        raise DataSourceError(f"data.tokenizer: {e}") from None


def encode_chat(
    tokenizer: Any, template: ChatTemplate, messages: Sequence[dict[str, Any]]
) -> tuple[list[int], list[int]]:
    """A conversation's token ids and its assistant-token mask (1 = an assistant token), as
    ``transformers``' ``apply_chat_template(messages, tokenize=True, return_dict=True,
    return_assistant_tokens_mask=True)`` gives ``input_ids`` and ``assistant_masks``.

    Raises:
        ValueError: the template failed on the messages.
    """
    text, spans = template.render_with_spans(messages)
    ids, char_to_token = tokenizer.encode_with_char_map(text)
    return ids, assistant_token_mask(len(ids), spans, char_to_token)


def _encoded_chats(
    files: Sequence[Path], tokenizer: Tokenizer, loss_on: LossOn
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """``(token ids, assistant mask)`` of each chat record of ``files``, rendered with the tokenizer's template."""
    template = chat_template_of(tokenizer)
    for where, messages in read_chats(files):
        try:
            tokens, mask = encode_chat(tokenizer, template, messages)
        except ValueError as e:
            raise DataSourceError(f"{where}: {e}") from None
        if loss_on == "assistant" and not any(mask):
            raise DataSourceError(f"{where}: {NO_ASSISTANT_TOKEN}")
        yield np.asarray(tokens, dtype=np.int32), np.asarray(mask, dtype=np.uint8)


def _pack_chat_documents(
    chats: Sequence[tuple[np.ndarray, np.ndarray]], seq_len: int, loss_on: LossOn, what: str
) -> PackedTokens:
    """Encoded chats packed into rows, their boundaries kept as offsets (``what`` names them in errors)."""
    if not chats:
        raise DataSourceError(f"{what}: no chat records")
    lengths = np.asarray([len(ids) for ids, _ in chats], dtype=np.int64)
    try:
        return PackedTokens(
            np.concatenate([ids for ids, _ in chats]),
            seq_len,
            None,
            doc_offsets=np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64),
            loss_mask=np.concatenate([mask for _, mask in chats]) if loss_on == "assistant" else None,
        )
    except ValueError as e:
        raise DataSourceError(f"{what}: {e}") from None


def _pack_chats(files: Sequence[Path], seq_len: int, tokenizer: Tokenizer, loss_on: LossOn) -> PackedTokens:
    chats = list(_encoded_chats(files, tokenizer, loss_on))
    if not chats:
        raise DataSourceError(f"data.source: no chat records in {', '.join(map(str, files))}")
    return _pack_chat_documents(chats, seq_len, loss_on, "data.source")


def _holds(files: Sequence[Path], fmt: str) -> dict[str, str]:
    """What each format that reads ``files`` holds (:attr:`DataFormatSpec.holds`), by format name."""
    return {spec.name: spec.holds for spec in (_format_of(p, fmt) for p in files)}


def token_dtype(vocab_size: int) -> Any:
    """The token-file dtype of a vocabulary: ``uint16`` below 65536 ids, else ``uint32``."""
    return np.uint16 if vocab_size <= 2**16 else np.uint32


def _read_tokenized_dir(path: Path, tokenizer: Tokenizer) -> tuple[np.memmap, np.ndarray, np.ndarray | None]:
    """The memory-mapped tokens, document offsets and (conversations) assistant mask of a ``tokenize``
    output directory."""
    meta = json.loads((path.parent / META_FILE).read_text())
    if meta.get("vocab_size") != tokenizer.vocab_size or meta.get("eos_id") != tokenizer.eos_id:
        raise DataSourceError(
            f"{path.parent}: tokenized with a tokenizer of {meta.get('vocab_size')} ids and eos "
            f"{meta.get('eos_id')}, but data.tokenizer has {tokenizer.vocab_size} ids and eos {tokenizer.eos_id}"
        )
    try:
        tokens = read_token_file(path, np.dtype(meta["dtype"]))
    except ValueError as e:
        raise DataSourceError(str(e)) from None
    offsets = np.load(path.parent / DOCUMENTS_FILE, mmap_mode="r")
    if len(tokens) != meta["num_tokens"] or len(offsets) != meta["num_documents"]:
        raise DataSourceError(f"{path.parent}: {TOKENS_FILE} or {DOCUMENTS_FILE} does not match {META_FILE}")
    mask = np.load(path.parent / MASK_FILE, mmap_mode="r") if (path.parent / MASK_FILE).is_file() else None
    if mask is not None and len(mask) != len(tokens):
        raise DataSourceError(f"{path.parent}: {MASK_FILE} does not match {TOKENS_FILE}")
    return tokens, offsets, mask


def _read_tokens(files: Sequence[Path], tokenizer: Tokenizer) -> Any:
    """The token files memory-mapped (several: one :class:`ConcatenatedTokens` of their maps), each
    checked against the tokenizer's vocabulary."""
    dtype = token_dtype(tokenizer.vocab_size)
    arrays = []
    for path in files:
        try:
            arr = read_token_file(path, dtype)
        except ValueError as e:
            raise DataSourceError(str(e)) from None
        if arr.size and int(arr.max()) >= tokenizer.vocab_size:
            raise DataSourceError(
                f"{path}: token id {int(arr.max())} is outside the tokenizer's {tokenizer.vocab_size} ids"
            )
        arrays.append(arr)
    return arrays[0] if len(arrays) == 1 else ConcatenatedTokens(arrays)


def _encode_document(tokenizer: Tokenizer, text: str) -> list[int]:
    """The document's ids with the tokenizer's special tokens, ending in eos (the document separator)."""
    encode_document = getattr(tokenizer, "encode_document", None)
    ids = list(encode_document(text)) if encode_document is not None else tokenizer.encode(text)
    if not ids or ids[-1] != tokenizer.eos_id:
        ids.append(tokenizer.eos_id)
    return ids


def build_packed_corpus(
    files: Sequence[Path],
    seq_len: int,
    tokenizer: Tokenizer,
    fmt: str = "auto",
    text_field: str = "text",
    *,
    strict_utf8: bool = True,
    loss_on: LossOn = "assistant",
) -> PackedTokens:
    """``files`` tokenised (or, for ``tokens``, memory-mapped) and packed into rows of ``seq_len``.

    Each document gets the tokenizer's special tokens (:meth:`HFTokenizer.encode_document`) and ends
    in its eos token, which :class:`PackedTokens` takes as the document boundary. ``strict_utf8``: see
    :func:`read_documents`. A ``chat`` record is one document, rendered with the tokenizer's chat
    template (:func:`encode_chat`), its boundaries kept as offsets; with ``loss_on="assistant"`` only
    its assistant tokens are targets, with ``"all"`` every token is.

    Raises:
        DataSourceError: bad input, or too few tokens for one row.
    """
    kinds = _holds(files, fmt)
    if set(kinds.values()) == {"chats"}:
        return _pack_chats(files, seq_len, tokenizer, loss_on)
    if "tokens" in kinds.values():
        if set(kinds.values()) != {"tokens"}:
            others = sorted(k for k, holds in kinds.items() if holds != "tokens")
            raise DataSourceError(f"data.source: token files mixed with {others} files")
        offsets = mask = None
        if len(files) == 1 and is_tokenized_dir(files[0].parent) and files[0].name == TOKENS_FILE:
            tokens, offsets, mask = _read_tokenized_dir(files[0], tokenizer)  # memory-mapped, with its index
        else:
            tokens = _read_tokens(files, tokenizer)
        try:
            return PackedTokens(
                tokens,
                seq_len,
                tokenizer.eos_id,
                doc_offsets=offsets,
                loss_mask=mask if loss_on == "assistant" else None,
            )
        except ValueError as e:
            raise DataSourceError(f"data.source: {e}") from None
    docs = (
        _encode_document(tokenizer, text)
        for text in read_documents(files, fmt, text_field, strict_utf8=strict_utf8)
    )
    try:
        return pack_documents(docs, seq_len, tokenizer.eos_id, append_eos=False)
    except ValueError as e:
        raise DataSourceError(f"data.source: {e}") from None


@dataclass(frozen=True)
class DocumentHoldout:
    """The documents of a corpus held out for validation (never trained on).

    ``amount`` documents (an ``int`` >= 1), or that fraction of them (a ``float`` in (0, 1); at least
    one), drawn by a generator seeded with ``seed`` alone: the split is a function of the number of
    documents and the seed, the same in every process, for any world size, and on every resume.
    A document is a text file, a JSONL line, a parquet or arrow row, or a chat record.
    """

    amount: int | float
    seed: int = 0

    def count(self, num_documents: int) -> int:
        """How many of ``num_documents`` documents are held out."""
        if isinstance(self.amount, int):
            return self.amount
        return max(1, round(self.amount * num_documents))

    def held_out(self, num_documents: int) -> np.ndarray:
        """The sorted indices of the held-out documents among ``num_documents``.

        Raises:
            ValueError: the hold-out would leave no document to train on.
        """
        k = self.count(num_documents)
        if k >= num_documents:
            raise ValueError(f"holding out {k} of {num_documents} document(s) leaves none to train on")
        rng = np.random.Generator(np.random.PCG64(self.seed))
        return np.sort(rng.permutation(num_documents)[:k])


def build_packed_splits(
    files: Sequence[Path],
    seq_len: int,
    tokenizer: Tokenizer,
    holdout: DocumentHoldout,
    fmt: str = "auto",
    text_field: str = "text",
    *,
    strict_utf8: bool = True,
    loss_on: LossOn = "assistant",
    name: str = "data.source",
) -> tuple[PackedTokens, PackedTokens | DataSourceError]:
    """The documents of ``files`` split by ``holdout`` into ``(training, validation)``, each tokenised and
    packed as :func:`build_packed_corpus` packs them (documents keep their order within each split).

    ``name`` is the config field of the source, for the messages. A validation split too small for one
    row is returned as its error (raise it where validation is needed; training alone may go on).

    Raises:
        DataSourceError: bad input, token files (their documents are not read one by one), a hold-out
            that leaves no document to train on, or a split with too few tokens for one row.
    """
    kinds = _holds(files, fmt)
    chats = set(kinds.values()) == {"chats"}
    if "tokens" in kinds.values():
        raise DataSourceError(
            f"{name}: documents cannot be held out of token files; give data.validation_source "
            "(or data.validation_files=0 with evaluation.enabled=false)"
        )
    if chats:
        docs: list[Any] = list(_encoded_chats(files, tokenizer, loss_on))
    else:
        texts = read_documents(files, fmt, text_field, strict_utf8=strict_utf8)
        docs = [np.asarray(_encode_document(tokenizer, text), dtype=np.int32) for text in texts]
    try:
        held = holdout.held_out(len(docs))
    except ValueError as e:
        raise DataSourceError(f"data.validation_documents={holdout.amount}: {name}: {e}") from None
    is_held = np.zeros(len(docs), dtype=bool)
    is_held[held] = True
    splits = ([d for d, h in zip(docs, is_held) if not h], [d for d, h in zip(docs, is_held) if h])
    names = (f"{name} (training)", f"{name} (the {len(held)} held-out document(s) for validation)")
    packed: list[PackedTokens | DataSourceError] = []
    for split, what in zip(splits, names):
        try:
            if chats:
                packed.append(_pack_chat_documents(split, seq_len, loss_on, what))
            else:
                packed.append(pack_documents(split, seq_len, tokenizer.eos_id, append_eos=False))
        except DataSourceError as e:
            packed.append(e)
        except ValueError as e:
            packed.append(DataSourceError(f"{what}: {e}"))
    if isinstance(packed[0], DataSourceError):
        raise packed[0]
    return packed[0], packed[1]
