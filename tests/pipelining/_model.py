"""A tiny transformer-like model split into pipeline stages, and its single-process reference."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, HIDDEN, SEQ = 11, 8, 3


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.up = nn.Linear(HIDDEN, 2 * HIDDEN)
        self.down = nn.Linear(2 * HIDDEN, HIDDEN)
        self.mix = nn.Linear(HIDDEN, HIDDEN, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        # token mixing along the sequence (a causal cumulative mean) keeps it transformer-like
        n = torch.arange(1, h.shape[1] + 1, dtype=h.dtype, device=h.device).view(1, -1, 1)
        h = h + self.mix(h.cumsum(1) / n)
        return h + self.down(F.gelu(self.up(self.norm(h))))


class Stage(nn.Module):
    """Stage s: (embedding if first) + block + (head if last). Passes an int tensor along to test comm."""

    def __init__(self, index: int, num_stages: int) -> None:
        super().__init__()
        self.index, self.num_stages = index, num_stages
        self.embed = nn.Embedding(VOCAB, HIDDEN) if index == 0 else None
        self.block = Block()
        self.head = nn.Linear(HIDDEN, VOCAB) if index == num_stages - 1 else None

    def forward(self, input_ids=None, h=None, pos=None):  # type: ignore[no-untyped-def]
        if self.embed is not None:
            h = self.embed(input_ids)
            pos = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        h = self.block(h) + 0.01 * pos.unsqueeze(-1).to(h.dtype)
        if self.head is not None:
            return {"logits": self.head(h)}
        return {"h": h, "pos": pos}


def make_stages(num_stages: int, seed: int = 0) -> dict[int, Stage]:
    torch.manual_seed(seed)
    return {s: Stage(s, num_stages) for s in range(num_stages)}


def make_batch(batch: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (batch, SEQ), generator=g)
    return ids, labels


def loss_fn(outputs, mb):  # type: ignore[no-untyped-def]
    return F.cross_entropy(outputs["logits"].flatten(0, 1), mb["labels"].flatten())


def reference(num_stages: int, batch: int) -> tuple[torch.Tensor, dict[int, dict[str, torch.Tensor]]]:
    """Loss and per-stage parameter gradients of the whole model on the whole batch, one process."""
    stages = make_stages(num_stages)
    ids, labels = make_batch(batch)
    out = {"input_ids": ids}
    for s in range(num_stages):
        out = stages[s](**out)
    loss = F.cross_entropy(out["logits"].flatten(0, 1), labels.flatten())
    loss.backward()
    grads = {s: {n: p.grad.clone() for n, p in m.named_parameters()} for s, m in stages.items()}
    return loss.detach(), grads


def copies(stages: dict[int, Stage], keep) -> dict[int, Stage]:  # type: ignore[no-untyped-def]
    return {s: copy.deepcopy(stages[s]) for s in keep}
