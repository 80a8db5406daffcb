"""Token embedding, causal-LM head (fused linear cross-entropy) and hidden-state pooling."""

from __future__ import annotations

from typing import Any, Literal, cast

import torch
import torch.distributed as dist
from plait.kernels import linear_cross_entropy
from plait.model_state import local_view
from plait.models.common.attention.context.allgather import gather_stacked
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

__all__ = ["LMHead", "PoolingMethod", "TokenEmbedding", "pool_hidden_states"]

PoolingMethod = Literal["last", "mean"]


class _ReduceScatterRows(torch.autograd.Function):
    """Sum ``part [P * N, H]`` over the group and keep this rank's ``N`` rows; the backward all-gathers the
    gradient and divides it by ``factor``. Plain tensors in and out (torch's functional collectives return
    a tensor subclass, which the compiled layers downstream would take as a new kind of input)."""

    @staticmethod
    def forward(ctx: Any, part: torch.Tensor, group: dist.ProcessGroup, factor: float) -> torch.Tensor:
        ctx.group, ctx.factor = group, factor
        out = part.new_empty(part.shape[0] // dist.get_world_size(group), *part.shape[1:])
        dist.reduce_scatter_tensor(out, part.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        full = gather_stacked(grad, ctx.group).flatten(0, 1)
        return (full if ctx.factor == 1 else full / ctx.factor), None, None


class TokenEmbedding(nn.Embedding):
    """Token embedding (``nn.Embedding``; the tensor-parallel plan makes it vocab-parallel; under FSDP
    :meth:`shard_rows` can keep its rows sharded over the data-parallel ranks, never gathered)."""

    def __init__(self, vocab_size: int, hidden_size: int, padding_idx: int | None = None) -> None:
        super().__init__(vocab_size, hidden_size, padding_idx=padding_idx)
        self.row_mesh: DeviceMesh | None = None
        self.row_dtype: torch.dtype | None = None
        self.gradient_divide_factor: float | None = None

    def shard_rows(self, mesh: DeviceMesh, dtype: torch.dtype | None = None) -> None:
        """Keep the table sharded by rows over the 1-D ``mesh`` (a ``Shard(0)`` DTensor, what FSDP2 holds) and
        look tokens up without gathering it.

        Each lookup all-gathers every rank's token ids, embeds those that fall in this rank's rows (zeros
        for the others) and reduce-scatters the result, so each rank gets its own tokens' vectors (exact:
        one rank contributes each). The backward all-gathers their gradients and each rank adds them into
        its rows: the table's gradient comes out already reduced over the ranks, divided by
        :meth:`set_gradient_divide_factor`'s factor (default: the mesh's size, FSDP2's mean). The table's
        all-gather and reduce-scatter, which FSDP2 runs at the step's two ends where no compute hides them,
        become exchanges of the tokens' vectors. Every rank must pass the same number of tokens (checked on
        the device, without a host wait). ``dtype``: the vectors' dtype (FSDP2's mixed-precision
        ``param_dtype``; None: the table's).

        Raises:
            ValueError: ``mesh`` is not 1-D (HSDP), or the table is already a DTensor (tensor parallelism).
        """
        if mesh.ndim != 1:
            raise ValueError(
                "parallel.shard_embedding_rows (TokenEmbedding.shard_rows) shards the table over one "
                f"data-parallel dim; this layout replicates it too (HSDP: mesh.data_replicate > 1, a "
                f"{mesh.ndim}-D data mesh)"
            )
        if isinstance(self.weight, DTensor):
            raise ValueError(
                "parallel.shard_embedding_rows (TokenEmbedding.shard_rows) cannot apply under tensor "
                "parallelism (mesh.tensor > 1): the table is already sharded by vocabulary"
            )
        table = distribute_tensor(self.weight.detach(), mesh, [Shard(0)], src_data_rank=None)
        self.weight = nn.Parameter(table, requires_grad=self.weight.requires_grad)
        self.row_mesh, self.row_dtype = mesh, dtype

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide the row-sharded table's gradient by ``factor`` (1: the ranks' sum), as FSDP2's method of
        that name does for its units."""
        self.gradient_divide_factor = factor

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.row_mesh is None:
            return super().forward(input_ids)
        mesh = self.row_mesh
        group, ranks = mesh.get_group(), mesh.size()
        assert isinstance(self.weight, DTensor)
        local = self.weight.to_local()  # differentiable: its gradient becomes the DTensor's, Shard(0)
        start = mesh.get_local_rank() * -(-self.num_embeddings // ranks)  # torch.chunk's shard size
        ids = input_ids.reshape(-1)
        count = torch.full((1,), ids.numel(), dtype=torch.int64, device=ids.device)
        torch._assert_async(  # noqa: SLF001  a device-side check: no host wait
            torch.all(gather_stacked(count, group) == count),
            "TokenEmbedding.shard_rows (parallel.shard_embedding_rows): every data-parallel rank must pass "
            "the same number of tokens",
        )
        every = gather_stacked(ids, group).flatten()
        outside = (every < start) | (every >= start + local.shape[0])
        pad = self.padding_idx
        local_pad = pad - start if pad is not None and 0 <= pad - start < local.shape[0] else None
        part = nn.functional.embedding(every.sub(start).masked_fill(outside, 0), local, local_pad)
        part = part.masked_fill(outside.unsqueeze(-1), 0).to(self.row_dtype or part.dtype)
        factor = ranks if self.gradient_divide_factor is None else self.gradient_divide_factor
        out = _ReduceScatterRows.apply(part, group, factor)
        return out.view(*input_ids.shape, -1)

    def reset_parameters(self, std: float = 1.0) -> None:  # type: ignore[override]
        """Normal(0, std); the padding row (if any) is zeroed like Hugging Face's init."""
        nn.init.normal_(self.weight, 0.0, std)
        if self.padding_idx is not None:
            with torch.no_grad():
                self.weight[self.padding_idx].zero_()


class LMHead(nn.Linear):
    """Causal-LM head ``[V, H]`` whose loss never materialises the logits.

    :meth:`loss` calls ``plait.kernels.linear_cross_entropy`` (chunked / fused); :meth:`logits`
    computes logits for inference. Under tensor parallelism the weight is a vocab-sharded DTensor
    (``Shard(0)``) and the loss becomes a vocab-parallel cross-entropy over ``tp_group``.

    ``grad_in_forward`` is passed to the kernel: ``None`` (default) computes the loss's gradients in
    its forward when training (one pass over the classifier instead of two; the gradients of the
    classifier and the hidden states are held until the backward), ``False`` keeps the two-pass
    loss, e.g. for a pipeline schedule that runs many forwards before their backwards (GPipe;
    ``plait.loop`` asks for it through :meth:`use_two_pass_loss`).
    """

    def __init__(self, hidden_size: int, vocab_size: int) -> None:
        super().__init__(hidden_size, vocab_size, bias=False)
        self.tp_group: dist.ProcessGroup | None = None
        self.grad_in_forward: bool | None = None

    def loss(
        self,
        hidden: torch.Tensor,
        labels: torch.Tensor,
        *,
        ignore_index: int = -100,
        reduction: Literal["mean", "sum"] = "mean",
    ) -> torch.Tensor:
        """Cross-entropy of ``hidden [..., H]`` against ``labels [...]`` (already aligned targets).

        Args:
            hidden: Final (normed) hidden states.
            labels: Target token per position; ``ignore_index`` positions are skipped.
            ignore_index: Label value to ignore.
            reduction: ``mean`` over non-ignored tokens or ``sum``.
        """
        # With tp_group the kernel combines the vocab shards and all-reduces the hidden gradient.
        h = hidden.reshape(-1, hidden.shape[-1])
        loss = linear_cross_entropy(
            h,
            local_view(self.weight),
            labels.reshape(-1),
            ignore_index=ignore_index,
            reduction=reduction,
            process_group=self.tp_group,
            grad_in_forward=self.grad_in_forward,
        )
        assert isinstance(loss, torch.Tensor)
        return loss

    def use_two_pass_loss(self) -> bool:
        """Compute the loss's gradients in the backward (``grad_in_forward=False``) unless chosen explicitly.

        Returns:
            Whether the mode changed (False: ``grad_in_forward`` was already set and is kept).
        """
        if self.grad_in_forward is not None:
            return False
        self.grad_in_forward = False
        return True

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits ``[..., V]`` (gathered over the tensor-parallel group if sharded): the
        module's call, so that its hooks (FSDP2's gathering) run."""
        return cast(torch.Tensor, self(hidden))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Same as :meth:`logits`."""
        out = nn.functional.linear(hidden, local_view(self.weight))
        if self.tp_group is not None:
            parts = [torch.empty_like(out) for _ in range(dist.get_world_size(self.tp_group))]
            dist.all_gather(parts, out.contiguous(), group=self.tp_group)
            out = torch.cat(parts, dim=-1)
        return out

    def reset_parameters(self, std: float = 0.02) -> None:  # type: ignore[override]
        """Normal(0, std)."""
        nn.init.normal_(self.weight, 0.0, std)


def pool_hidden_states(
    hidden: torch.Tensor,
    method: PoolingMethod = "last",
    *,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pool ``hidden [B, S, H]`` into ``[B, H]`` for classification or embedding heads.

    Args:
        hidden: Hidden states.
        method: ``last`` takes the right-most token whose mask is 1 (the last token if no mask);
            ``mean`` averages the masked tokens.
        attention_mask: ``[B, S]`` 1 for real tokens, 0 for padding.
    """
    b, s, _ = hidden.shape
    if attention_mask is None:
        attention_mask = torch.ones(b, s, dtype=torch.long, device=hidden.device)
    if tuple(attention_mask.shape) != (b, s):
        raise ValueError(f"attention_mask must have shape {(b, s)}, got {tuple(attention_mask.shape)}")
    mask = attention_mask.to(hidden.device)
    if method == "last":
        idx = (torch.arange(s, device=hidden.device) * (mask != 0)).argmax(-1)
        return hidden[torch.arange(b, device=hidden.device), idx]
    if method == "mean":
        w = (mask != 0).to(hidden.dtype).unsqueeze(-1)
        return (hidden * w).sum(1) / w.sum(1).clamp_min(1.0)
    raise ValueError(f"pooling method must be 'last' or 'mean', got {method!r}")
