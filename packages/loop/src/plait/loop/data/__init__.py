"""Data: a stateful distributed loader, packing, collation, readers and tokenizers."""

from plait.loop.data.chat import ChatTemplate
from plait.loop.data.collate import PadCollator
from plait.loop.data.loader import DistributedDataLoader
from plait.loop.data.mixture import MixtureDataset, mixture_counts
from plait.loop.data.packing import PackedTokens, pack_documents
from plait.loop.data.readers import (
    ConcatenatedTokens,
    read_hf_texts,
    read_jsonl_records,
    read_jsonl_texts,
    read_text_file,
    read_token_file,
    write_token_file,
)
from plait.loop.data.sampler import GlobalBatchPlan
from plait.loop.data.sources import (
    FORMATS,
    DataSourceError,
    DocumentHoldout,
    build_packed_corpus,
    build_packed_splits,
    chat_template_of,
    encode_chat,
    infer_format,
    read_chats,
    read_documents,
    resolve_source,
    token_dtype,
)
from plait.loop.data.tokenize import tokenize_corpus
from plait.loop.data.tokenizers import (
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    copy_tokenizer_files,
    has_tokenizer,
)

__all__ = [
    "FORMATS",
    "ByteTokenizer",
    "ChatTemplate",
    "ConcatenatedTokens",
    "DataSourceError",
    "DistributedDataLoader",
    "DocumentHoldout",
    "GlobalBatchPlan",
    "HFTokenizer",
    "MixtureDataset",
    "PackedTokens",
    "PadCollator",
    "Tokenizer",
    "build_packed_corpus",
    "build_packed_splits",
    "chat_template_of",
    "copy_tokenizer_files",
    "encode_chat",
    "has_tokenizer",
    "infer_format",
    "mixture_counts",
    "pack_documents",
    "read_chats",
    "read_documents",
    "read_hf_texts",
    "read_jsonl_records",
    "read_jsonl_texts",
    "read_text_file",
    "read_token_file",
    "resolve_source",
    "token_dtype",
    "tokenize_corpus",
    "write_token_file",
]
