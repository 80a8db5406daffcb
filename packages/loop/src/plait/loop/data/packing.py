"""Packing documents into fixed-length sequences, with document ids and position ids for masking."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

__all__ = ["PackedTokens", "pack_documents"]


class PackedTokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """A flat token stream (array or ``np.memmap``) read as fixed windows of ``seq_len`` + 1 tokens.

    Sample ``i`` covers ``tokens[i*seq_len : i*seq_len + seq_len + 1]`` and returns ``input_ids``
    (the first ``seq_len``), ``labels`` (the next-token targets), ``position_ids`` (restarting at each
    document) and ``document_ids`` (0, 1, ... within the window). A document starts after every
    ``eos_id``, or, with ``doc_offsets``, at each of those offsets (for documents that hold eos inside,
    such as chats). With ``mask_cross_document=True`` the label of a document's last token (predicting
    the next document's first token) is ``ignore_index``. With ``loss_mask`` a label is kept only where
    the mask of the token it predicts is set (e.g. the assistant tokens of a chat).

    Args:
        tokens: 1-d integer array-like (numpy array or memmap; read lazily per sample).
        seq_len: tokens per sample.
        eos_id: the document separator, or None for one unbroken document (or ``doc_offsets``).
        mask_cross_document: mask labels that cross a document boundary.
        ignore_index: the masked label value.
        doc_offsets: sorted start offsets of the documents in ``tokens`` (instead of ``eos_id``).
        loss_mask: per-token 0/1 array-like as long as ``tokens``: which tokens are targets.
    """

    def __init__(
        self,
        tokens: Any,
        seq_len: int,
        eos_id: int | None = None,
        mask_cross_document: bool = True,
        ignore_index: int = -100,
        doc_offsets: Any = None,
        loss_mask: Any = None,
    ) -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        self.tokens = tokens
        self.seq_len = seq_len
        self.eos_id = eos_id
        self.mask_cross_document = mask_cross_document
        self.ignore_index = ignore_index
        self.doc_offsets = doc_offsets
        self.loss_mask = loss_mask
        if loss_mask is not None and len(loss_mask) != len(tokens):
            raise ValueError(f"loss_mask has {len(loss_mask)} entries for {len(tokens)} tokens")
        self._n = max((len(tokens) - 1) // seq_len, 0)
        if self._n == 0:
            raise ValueError(f"{len(tokens)} tokens are too few for one sequence of seq_len={seq_len}")

    def __len__(self) -> int:
        return self._n

    @property
    def num_documents(self) -> int:
        """The documents of the stream: ``doc_offsets``' count, or the ``eos_id`` tokens (plus a last
        document that does not end in one); 1 without either. Reads every token of a memory map."""
        if self.doc_offsets is not None:
            return len(self.doc_offsets)
        if self.eos_id is None:
            return 1
        tokens = np.asarray(self.tokens)
        return int(np.count_nonzero(tokens == self.eos_id)) + int(tokens[-1] != self.eos_id)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < self._n:
            raise IndexError(f"sample {i} out of range [0, {self._n})")
        # numpy throughout (a few microseconds per call, where a torch op costs several): the training
        # process builds every step's batch between its launches.
        n, start = self.seq_len, i * self.seq_len
        window = np.asarray(self.tokens[start : start + n + 1]).astype(np.int64)
        doc = np.zeros(n + 1, dtype=np.int64)
        if self.doc_offsets is not None:
            offsets = self.doc_offsets
            lo = int(np.searchsorted(offsets, start, "right"))
            hi = int(np.searchsorted(offsets, start + n + 1, "left"))
            doc[np.asarray(offsets[lo:hi], dtype=np.int64) - start] = 1
            np.cumsum(doc, out=doc)
        elif self.eos_id is not None:  # a new document begins right after each eos
            np.cumsum(window[:-1] == self.eos_id, out=doc[1:])
        inputs, labels = window[:-1], window[1:].copy()
        doc_in = doc[:-1]
        if self.mask_cross_document and (self.eos_id is not None or self.doc_offsets is not None):
            labels[doc[1:] != doc_in] = self.ignore_index
        if self.loss_mask is not None:
            target = np.asarray(self.loss_mask[start + 1 : start + n + 1])
            labels[target == 0] = self.ignore_index
        idx = np.arange(n, dtype=np.int64)
        is_start = np.ones(n, dtype=bool)
        is_start[1:] = doc_in[1:] != doc_in[:-1]
        first = np.maximum.accumulate(np.where(is_start, idx, 0))
        return {
            "input_ids": torch.from_numpy(inputs),
            "labels": torch.from_numpy(labels),
            "position_ids": torch.from_numpy(idx - first),
            "document_ids": torch.from_numpy(doc_in),
        }


def pack_documents(
    docs: Iterable[Sequence[int]],
    seq_len: int,
    eos_id: int,
    *,
    mask_cross_document: bool = True,
    dtype: Any = np.int32,
    append_eos: bool = True,
) -> PackedTokens:
    """Concatenate tokenised documents, each followed by ``eos_id``, into a :class:`PackedTokens`.

    With ``append_eos=False`` the documents are taken as they are (each already ending in ``eos_id``).
    """
    parts: list[np.ndarray] = []
    for d in docs:
        parts.append(np.asarray(d, dtype=dtype))
        if append_eos:
            parts.append(np.asarray([eos_id], dtype=dtype))
    if not parts:
        raise ValueError("pack_documents: no documents")
    return PackedTokens(np.concatenate(parts), seq_len, eos_id, mask_cross_document)
