"""Padding and collation of token samples into microbatch tensors."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = ["PadCollator"]


class PadCollator:
    """Stack samples (dicts of 1-d int sequences) into ``[B, T]`` tensors, padding on the right.

    Keys get their own pad value: ``input_ids`` -> ``pad_id``, ``labels`` -> ``ignore_index``,
    ``position_ids`` -> 0, ``document_ids`` -> -1 (a document id no real token has), anything else
    -> 0. When samples differ in length an ``attention_mask`` (1 real, 0 pad) is added.

    Args:
        pad_id: the padding token id.
        ignore_index: label of padded positions (skipped by the loss).
        pad_to_multiple_of: round the padded length up (e.g. 8 for tensor cores).
        max_length: truncate longer samples.
    """

    def __init__(
        self,
        pad_id: int = 0,
        ignore_index: int = -100,
        pad_to_multiple_of: int = 1,
        max_length: int | None = None,
    ) -> None:
        self.pad_values = {"input_ids": pad_id, "labels": ignore_index, "position_ids": 0, "document_ids": -1}
        self.pad_to_multiple_of = pad_to_multiple_of
        self.max_length = max_length

    def __call__(self, samples: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        if not samples:
            raise ValueError("PadCollator: empty microbatch")
        keys = list(samples[0].keys())
        rows = {k: [torch.as_tensor(s[k], dtype=torch.long) for s in samples] for k in keys}
        if self.max_length is not None:
            rows = {k: [r[: self.max_length] for r in v] for k, v in rows.items()}
        lengths = [len(r) for r in rows[keys[0]]]
        length = max(lengths)
        m = self.pad_to_multiple_of
        length = -(-length // m) * m
        out: dict[str, torch.Tensor] = {}
        for k, v in rows.items():
            for i, r in enumerate(v):
                if len(r) != lengths[i]:
                    raise ValueError(
                        f"PadCollator: sample {i} has {len(r)} {k!r} but {lengths[i]} {keys[0]!r}"
                    )
            if all(n == length for n in lengths):  # nothing to pad (packed rows): one copy
                out[k] = torch.stack(v)
                continue
            t = torch.full((len(v), length), self.pad_values.get(k, 0), dtype=torch.long)
            for i, r in enumerate(v):
                t[i, : len(r)] = r
            out[k] = t
        if len(set(lengths)) > 1 or length != lengths[0]:
            mask = torch.zeros((len(lengths), length), dtype=torch.long)
            for i, n in enumerate(lengths):
                mask[i, :n] = 1
            out["attention_mask"] = mask
        return out
