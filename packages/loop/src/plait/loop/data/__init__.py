"""Data: a stateful distributed loader, packing, collation, readers and tokenizers."""

from plait.loop.data.chat import ChatTemplate
from plait.loop.data.collate import PadCollator
from plait.loop.data.config import DataConfig, MixtureSource
from plait.loop.data.corpus import Corpus, build_tokenizer, corpus_files, recorded_tokenizer, validation_mode
from plait.loop.data.formats import (
    DataFormat,
    DataFormatSpec,
    ReadOptions,
    data_format,
    data_formats,
    format_of_extension,
    formats_reading,
    register_format,
)
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
    "ByteTokenizer",
    "ChatTemplate",
    "ConcatenatedTokens",
    "Corpus",
    "DataConfig",
    "DataFormat",
    "DataFormatSpec",
    "DataSourceError",
    "DistributedDataLoader",
    "DocumentHoldout",
    "GlobalBatchPlan",
    "HFTokenizer",
    "MixtureDataset",
    "MixtureSource",
    "PackedTokens",
    "PadCollator",
    "ReadOptions",
    "Tokenizer",
    "build_packed_corpus",
    "build_packed_splits",
    "build_tokenizer",
    "chat_template_of",
    "copy_tokenizer_files",
    "corpus_files",
    "data_format",
    "data_formats",
    "encode_chat",
    "format_of_extension",
    "formats_reading",
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
    "recorded_tokenizer",
    "register_format",
    "resolve_source",
    "token_dtype",
    "tokenize_corpus",
    "validation_mode",
    "write_token_file",
]
