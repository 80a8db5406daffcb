"""A tiny causal LM used by the loop tests (defined here: the loop must not know any model package)."""

from __future__ import annotations

import torch
from torch import nn

VOCAB = 32


class TinyLM(nn.Module):
    """Embedding -> LayerNorm -> MLP (residual) -> head; forward returns ``{"logits": ...}``."""

    def __init__(self, vocab: int = VOCAB, dim: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor, **_: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.embed(input_ids)
        h = h + self.down(torch.relu(self.up(self.norm(h))))
        return {"logits": self.head(h)}


def pattern_tokens(n_docs: int = 64, seed: int = 0) -> list[list[int]]:
    """Learnable documents: arithmetic sequences mod VOCAB-1 with random starts and strides."""
    g = torch.Generator().manual_seed(seed)
    docs = []
    for _ in range(n_docs):
        start = int(torch.randint(0, VOCAB - 1, (1,), generator=g))
        stride = int(torch.randint(1, 3, (1,), generator=g))
        length = int(torch.randint(6, 14, (1,), generator=g))
        docs.append([(start + i * stride) % (VOCAB - 1) for i in range(length)])
    return docs


class TinyStage0(nn.Module):
    """First pipeline stage of :class:`TinyLM` (same parameter names)."""

    def __init__(self, vocab: int = VOCAB, dim: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, input_ids: torch.Tensor, **_: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.embed(input_ids)
        return {"h": h + self.down(torch.relu(self.up(self.norm(h))))}


class TinyStage1(nn.Module):
    """Last pipeline stage of :class:`TinyLM`."""

    def __init__(self, vocab: int = VOCAB, dim: int = 16) -> None:
        super().__init__()
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, h: torch.Tensor, **_: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"logits": self.head(h)}


def tiny_stage(stage_index: int, num_stages: int) -> nn.Module:
    """``TinyLM`` split in two stages (or whole for one)."""
    if num_stages == 1:
        return TinyLM()
    return TinyStage0() if stage_index == 0 else TinyStage1()


def load_reference_weights(modules) -> None:
    """Copy the weights of a ``TinyLM`` seeded with 0 into the local stages (by parameter name)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    with torch.random.fork_rng():
        torch.manual_seed(0)
        ref = TinyLM().state_dict()
    with torch.no_grad():
        for m in modules:
            for name, p in m.named_parameters():
                if isinstance(p, DTensor):  # FSDP-sharded: copy this rank's shard
                    p.copy_(distribute_tensor(ref[name], p.device_mesh, p.placements))
                else:
                    p.copy_(ref[name])


class MeshContext:
    """The slice of ``plait.dist_core.DistributedContext`` the trainer reads: ``mesh_for("batch")`` and
    ``host_group`` (None: host-side collectives run on the default gloo group)."""

    host_group = None

    def __init__(self, pp: int, dp: int) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        self.mesh = init_device_mesh("cpu", (pp, dp, 1, 1), mesh_dim_names=("pp", "dp", "cp", "tp"))

    def mesh_for(self, name: str):
        assert name == "batch"
        return self.mesh
