"""Expert-parallel dispatch by all-gather and reduce-scatter of tokens (no host synchronisation).

Per forward: (1) all-gather every rank's tokens, routing weights and expert ids over the EP group
(``[P*T, H]``: every rank sees every token once, however many of its experts the token picked);
(2) permute the assignments to this rank's experts (other ranks' experts are skipped), grouped GEMM,
and sum each token's local expert outputs; (3) reduce-scatter the ``[P*T, H]`` partial sums, so each
rank gets its own tokens' outputs summed over all ranks' experts. The backward is the mirror image
(the all-gathers' backward reduce-scatters, the reduce-scatter's all-gathers).

All shapes are static and every index stays on the device, so the host never waits for the GPU and
a MoE decoder layer compiles as one graph. The exchanges move ``(P-1) * T`` token rows each way per
rank, against ``(P-1)/P * T * k`` rows for the exact-split all-to-all: fewer bytes whenever the EP
size is below ``k`` (top-``k``) or about. Each rank computes exactly its experts' assignments, as the
all-to-all does; its permuted buffer is sized for ``P * T * k`` rows (the static bound), of which the
grouped GEMM computes only the used ones.

With ``num_chunks > 1`` the local tokens are split into that many chunks: every chunk's all-gathers
are issued first, then each chunk is permuted, computed and reduce-scattered in turn, so that a
chunk's collectives can run while a neighbouring chunk's experts compute (the collectives are
asynchronous; in a compiled graph whether they overlap is up to Inductor's scheduling of their waits).
Each token is computed as without chunks; only the grouped GEMMs' row counts change.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from plait.kernels import permute, unpermute
from torch import Tensor

if TYPE_CHECKING:
    from plait.moe.experts import GroupedExperts


class AllGatherDispatcher:
    """Dispatch by all-gathering tokens over the EP group and reduce-scattering the expert outputs.

    Every rank of ``group`` must pass the same number of tokens (equal-shaped microbatches); a
    device-side assert stops the step otherwise (on CUDA an asynchronous error, raised at the next
    synchronisation).
    Functional collectives (``torch.distributed._functional_collectives``): traceable by
    ``torch.compile``, waited for where their results are first used (eagerly; a compiled graph
    waits right after each collective unless Inductor reorders it).

    Args:
        group: The EP process group.
        num_chunks: Token chunks whose exchanges are issued ahead of their compute (module
            docstring), capped at the token count. 1 (default) = no chunking.

    Raises:
        ValueError: ``num_chunks < 1``.
    """

    def __init__(self, group: dist.ProcessGroup, num_chunks: int = 1) -> None:
        if num_chunks < 1:
            raise ValueError(f"AllGatherDispatcher: num_chunks must be >= 1, got {num_chunks}")
        self.group = group
        self.ep_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.num_chunks = num_chunks

    def __call__(
        self,
        x: Tensor,
        topk_idx: Tensor,
        topk_weights: Tensor,
        experts: GroupedExperts,
        has_dropped: bool = False,
    ) -> Tensor:
        n_local = experts.num_experts // self.ep_size
        # Equal token counts on every rank, checked on the device (no host wait): an all-gather of
        # unequal shards would read past the smaller ones.
        tokens = torch.full((1,), x.shape[0], dtype=torch.int64, device=x.device)
        torch._assert_async(  # noqa: SLF001  the only device-side assertion (no host wait)
            torch.all(funcol.all_gather_tensor(tokens, 0, self.group) == tokens),
            "AllGatherDispatcher: every rank of the EP group must pass the same number of tokens",
        )
        n = max(1, min(self.num_chunks, x.shape[0]))  # static: every rank has the same token count
        gathered = [
            (
                funcol.all_gather_tensor_autograd(xc.contiguous(), 0, self.group),
                funcol.all_gather_tensor_autograd(wc.contiguous(), 0, self.group),
                # Ids of this rank's experts become [0, n_local); other ranks' experts and the
                # dropped sentinel E fall outside that range and are skipped by permute.
                funcol.all_gather_tensor(ic.contiguous(), 0, self.group) - self.rank * n_local,
            )
            for xc, wc, ic in zip(x.tensor_split(n), topk_weights.tensor_split(n), topk_idx.tensor_split(n))
        ]
        outs = []
        for xs, ws, ids in gathered:
            rows, row_w, row_map, counts = permute(xs, ids, n_local, ws)
            partial = unpermute(experts(rows, counts, row_w), row_map)
            outs.append(funcol.reduce_scatter_tensor_autograd(partial, "sum", 0, self.group))
        return outs[0] if n == 1 else torch.cat(outs)

    def __repr__(self) -> str:
        return f"AllGatherDispatcher(ep_size={self.ep_size}, num_chunks={self.num_chunks})"
