"""The context group of a model and the per-forward mask of its sharded sequences."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from plait.dist_core.context_parallel import gather_sequence, load_balanced_indices
from plait.models.common.attention.context._aten import chunk_kernels_available
from plait.models.common.attention.kernels import AttentionKernels
from plait.models.common.attention.mask import (
    AttentionMask,
    document_ids_from_position_ids,
    isolate_padding,
    padding_mask,
)

__all__ = ["ContextParallel", "ContextParallelMask", "ContextParallelMode"]

ContextParallelMode = Literal["ring", "allgather"]


@dataclass(frozen=True)
class ContextParallel:
    """The context group of a model and how its attention crosses ranks.

    Set by :func:`plait.models.parallelize` (``DecoderTrunk.context_parallel``); a model holding one
    expects every ``[B, S]`` input in the load-balanced layout (see
    :func:`plait.dist_core.shard_batch`).

    Attributes:
        group: The context-parallel process group (the batch domain's ``cp`` dimension).
        mode: ``"allgather"`` or ``"ring"`` (see the module docs).
    """

    group: dist.ProcessGroup
    mode: ContextParallelMode = "allgather"

    @property
    def size(self) -> int:
        """Ranks in the context group."""
        return dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        """This rank's index in the context group."""
        return dist.get_rank(self.group)

    def local_positions(self, local_len: int, device: torch.device) -> torch.Tensor:
        """Global positions ``[local_len]`` of this rank's tokens (the default ``position_ids``)."""
        return load_balanced_indices(local_len * self.size, self.size, self.rank, device=device)

    def build_mask(
        self,
        batch: int,
        local_len: int,
        device: torch.device,
        *,
        document_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        implementation: str = "auto",
        dtype: torch.dtype | None = None,
        kernels: AttentionKernels | None = None,
        sliding_window: int | None = None,
        sinks: bool = False,
    ) -> AttentionMask:
        """The attention mask of one forward for this rank's shard (collective over the group).

        Args:
            batch: Batch size.
            local_len: Tokens per row on this rank.
            device: Device of the activations.
            document_ids: ``[B, local_len]`` sharded document ids.
            position_ids: ``[B or 1, local_len]`` sharded positions; restarts (in the full sequence)
                mark packed documents when no ``document_ids`` are given. None: no documents.
            attention_mask: ``[B, local_len]`` sharded padding mask (transformers' meaning, 1 =
                token, 0 = padding). It is all-gathered, and each padding token of the full row
                becomes a document of its own, as in :func:`build_attention_mask`; the returned
                mask's ``padding_mask`` is this rank's part (MoE layers leave padding out).
            implementation: ``auto``, ``sdpa`` or ``flex`` (the ``allgather`` kernel). ``auto`` and
                ``sdpa`` run plain causal rows as per-chunk SDPA kernels where one returns its
                log-sum-exp (CPU; CUDA fp16/bf16 on Hopper or newer: cuDNN); otherwise ``auto`` is
                FlexAttention on CUDA and SDPA with a dense mask elsewhere. The ring has its own kernel.
            dtype: Activation dtype (the per-chunk cuDNN kernels need fp16/bf16); None: not known.
            kernels: The model's compiled-kernel cache (a new one if None).
            sliding_window: Keys a query sees, in global positions (None: full causal attention).
            sinks: The layers have attention sinks (they need the log-sum-exp: no per-chunk kernels).

        Raises:
            ValueError: ``flash`` or an unknown implementation, or shapes that do not match.
        """
        if implementation not in ("auto", "sdpa", "flex"):
            raise ValueError(
                f"attn_implementation={implementation!r} is not available with context parallelism; "
                "use auto, sdpa or flex"
            )
        n = self.size
        docs = self._gather_documents(batch, local_len, device, document_ids, position_ids)
        padding: torch.Tensor | None = None
        if attention_mask is not None:
            docs, padding = self._gather_padding(batch, local_len, device, attention_mask, docs)
        kernels = kernels or AttentionKernels()
        total = local_len * n
        window = sliding_window if sliding_window is not None and sliding_window < total else None
        q_pos = self.local_positions(local_len, device)
        cp = ContextParallelMask(self.group, self.mode, n, self.rank, local_len // 2, q_pos, docs, window)
        common: dict[str, Any] = {"kernels": kernels, "context": cp, "padding_mask": padding}
        if self.mode == "ring":
            return AttentionMask("sdpa", sliding_window=window, **common)
        plain = docs is None and window is None and not sinks
        if plain and implementation != "flex" and chunk_kernels_available(device, dtype):
            return AttentionMask("sdpa", **common)  # no mask: the chunks' kernels are causal
        backend = (
            implementation if implementation != "auto" else ("flex" if device.type == "cuda" else "sdpa")
        )
        if backend == "flex":
            block = _flex_block_mask(kernels, q_pos, docs, window, batch, total, device)
            return AttentionMask("flex", block_mask=block, sliding_window=window, **common)
        dense = _dense_mask(q_pos, docs, window, batch, total, device)
        return AttentionMask("sdpa", dense_mask=dense, sliding_window=window, **common)

    def _gather_documents(
        self,
        batch: int,
        local_len: int,
        device: torch.device,
        document_ids: torch.Tensor | None,
        position_ids: torch.Tensor | None,
    ) -> torch.Tensor | None:
        """``[B, T]`` document ids of the full sequence, or None when it holds one document."""
        if document_ids is not None:
            if tuple(document_ids.shape) != (batch, local_len):
                raise ValueError(
                    f"document_ids must have shape {(batch, local_len)} (this rank's shard), "
                    f"got {tuple(document_ids.shape)}"
                )
            return gather_sequence(document_ids.to(device), self.group)
        if position_ids is not None and local_len * self.size > 1:
            pos = gather_sequence(position_ids.to(device).expand(batch, local_len).contiguous(), self.group)
            if bool((pos[:, 1:] <= pos[:, :-1]).any()):
                return document_ids_from_position_ids(pos)
        return None

    def _gather_padding(
        self,
        batch: int,
        local_len: int,
        device: torch.device,
        attention_mask: torch.Tensor,
        docs: torch.Tensor | None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The document ids with each padding token isolated, and this rank's padding mask."""
        if tuple(attention_mask.shape) != (batch, local_len):
            raise ValueError(
                f"attention_mask must have shape {(batch, local_len)} (this rank's shard; 1 = "
                f"token, 0 = padding), got {tuple(attention_mask.shape)}"
            )
        full = gather_sequence(attention_mask.to(device).contiguous(), self.group)
        full_padding = padding_mask(full, batch, local_len * self.size, device)
        if full_padding is None:  # the same answer on every rank: the rows are the same
            return docs, None
        return isolate_padding(docs, full_padding), attention_mask.to(device=device, dtype=torch.bool)


def _flex_block_mask(
    kernels: AttentionKernels,
    q_pos: torch.Tensor,
    docs: torch.Tensor | None,
    window: int | None,
    batch: int,
    total: int,
    device: torch.device,
) -> Any:
    """FlexAttention block mask of the local queries against the full sequence's keys."""
    q_docs = None if docs is None else docs[:, q_pos]

    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        keep = q_pos[q_idx] >= kv_idx
        if window is not None:
            keep = keep & (q_pos[q_idx] - kv_idx < window)
        if docs is None or q_docs is None:
            return keep
        return keep & (q_docs[b, q_idx] == docs[b, kv_idx])

    return kernels.block_mask(mask_mod, batch, q_pos.numel(), total, device)


def _dense_mask(
    q_pos: torch.Tensor,
    docs: torch.Tensor | None,
    window: int | None,
    batch: int,
    total: int,
    device: torch.device,
) -> torch.Tensor:
    """``[B, 1, local_len, T]`` boolean mask of the local queries against the full sequence's keys."""
    kv_pos = torch.arange(total, device=device)
    dense = q_pos[:, None] >= kv_pos[None, :]
    if window is not None:
        dense = dense & (q_pos[:, None] - kv_pos[None, :] < window)
    dense = dense.expand(batch, q_pos.numel(), total)
    if docs is not None:
        dense = dense & (docs[:, q_pos, None] == docs[:, None, :])
    return dense[:, None]


@dataclass(frozen=True)
class ContextParallelMask:
    """What one forward's context-parallel attention needs (built by :meth:`ContextParallel.build_mask`).

    Attributes:
        group: The context group.
        mode: ``"allgather"`` or ``"ring"``.
        size: Ranks in the group.
        rank: This rank's index.
        chunk: Tokens per chunk (``local_len // 2``).
        q_positions: ``[local_len]`` global positions of the local tokens.
        document_ids: ``[B, T]`` document ids of the full sequence, or None (plain causal).
        sliding_window: Keys a query sees (global positions), or None.
    """

    group: dist.ProcessGroup
    mode: ContextParallelMode
    size: int
    rank: int
    chunk: int
    q_positions: torch.Tensor
    document_ids: torch.Tensor | None
    sliding_window: int | None = None

    def chunks_of(self, rank: int) -> tuple[int, int]:
        """The two chunk indices (of ``2 * size``) held by context rank ``rank``."""
        return rank, 2 * self.size - 1 - rank

    def peer(self, offset: int) -> int:
        """Global rank of the context rank ``offset`` steps ahead on the ring."""
        return dist.get_global_rank(self.group, (self.rank + offset) % self.size)

    def chunk_docs(self, chunk: int) -> torch.Tensor | None:
        """``[B, chunk]`` document ids of global chunk ``chunk`` (None without documents)."""
        if self.document_ids is None:
            return None
        return self.document_ids[:, chunk * self.chunk : (chunk + 1) * self.chunk]
