"""A token embedding whose rows stay sharded over the data-parallel ranks (``TokenEmbedding.shard_rows``,
``ParallelConfig.shard_embedding_rows``) against the same table in one process (on gloo, and on NCCL with two
GPUs): each rank's vectors, the table's reduced gradient (mean and sum), the padding row, uneven shards, the
compute dtype, a plain tensor out; unequal token counts stop on the device-side check; tied, HSDP and
tensor-parallel layouts are refused. The whole model under it: ``test_parallel.py``'s ``fsdp2_rows`` layout
(losses and every gradient against one process) and ``tests/train/test_planner.py``."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from plait.dist_core.testing import run_distributed
from plait.models.common.heads import TokenEmbedding

VOCAB, HIDDEN = 11, 4  # 11 rows over 2 ranks: shards of 6 and 5 rows


def _ids(world: int, tokens: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (world, 2, tokens), generator=g)
    ids[:, 0, 0] = 3  # the padding row, on every rank
    return ids


def _rank(padding_idx: int, divide: float | None, dtype: str | None, device: str) -> dict[str, torch.Tensor]:
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    embed = TokenEmbedding(VOCAB, HIDDEN, padding_idx=padding_idx).to(device)
    world, rank = dist.get_world_size(), dist.get_rank()
    embed.shard_rows(init_device_mesh(device, (world,)), getattr(torch, dtype) if dtype else None)
    if divide is not None:
        embed.set_gradient_divide_factor(divide)
    out = embed(_ids(world, 5)[rank].to(device))
    # a plain tensor: a subclass (torch's functional collectives' AsyncCollectiveTensor) is a new kind of input
    # to the compiled layers downstream (with CUDA graphs, a 1.14B MoE's step ran 2.3x slower on 2 x H200)
    assert type(out) is torch.Tensor, type(out)
    (out.float() * torch.arange(HIDDEN, device=device)).sum().backward()
    grad, table = embed.weight.grad.full_tensor(), embed.weight.full_tensor()
    return {"out": out.detach().cpu(), "grad": grad.cpu(), "table": table.detach().cpu()}


@pytest.mark.parametrize(
    ("padding_idx", "divide", "dtype"),
    [(3, None, None), (9, 1.0, None), (3, 1.0, "bfloat16")],
    ids=["mean-pad-on-rank0", "sum-pad-on-rank1", "sum-bf16-vectors"],
)
@pytest.mark.parametrize(
    "backend", ["gloo", pytest.param("nccl", marks=pytest.mark.multigpu)], ids=["gloo", "nccl"]
)
def test_row_sharded_lookup_equals_one_process(
    padding_idx: int, divide: float | None, dtype: str | None, backend: str
) -> None:
    world = 2
    device = "cuda" if backend == "nccl" else "cpu"
    results = run_distributed(_rank, world, padding_idx, divide, dtype, device, backend=backend)
    torch.manual_seed(0)
    ref = TokenEmbedding(VOCAB, HIDDEN, padding_idx=padding_idx)
    torch.testing.assert_close(results[0]["table"], ref.weight.detach(), rtol=0, atol=0)
    ids = _ids(world, 5)
    out = ref(ids.reshape(world * 2, 5))
    (out * torch.arange(HIDDEN)).sum().backward()
    assert ref.weight.grad is not None
    expected_grad = ref.weight.grad / (world if divide is None else divide)
    for rank, r in enumerate(results):
        want = out.detach().view(world, 2, 5, HIDDEN)[rank]
        torch.testing.assert_close(r["out"], want.to(r["out"].dtype), rtol=0, atol=0)
        torch.testing.assert_close(r["grad"], expected_grad, rtol=1e-6, atol=1e-6)
    assert not results[0]["grad"][padding_idx].any()  # nn.Embedding's padding row gets no gradient


def _unequal_counts() -> str:
    from torch.distributed.device_mesh import init_device_mesh

    embed = TokenEmbedding(VOCAB, HIDDEN)
    embed.shard_rows(init_device_mesh("cpu", (2,)))
    try:
        embed(torch.zeros(1, 4 + dist.get_rank(), dtype=torch.long))
    except RuntimeError as e:
        return str(e)
    return ""


def test_unequal_token_counts_stop_naming_the_key() -> None:
    messages = run_distributed(_unequal_counts, 2)
    assert all("parallel.shard_embedding_rows" in m and "same number of tokens" in m for m in messages), (
        messages
    )


def _refusal(dense: tuple[int, ...], tied: bool) -> str:
    from plait.models import ParallelConfig, parallelize
    from torch.distributed.device_mesh import init_device_mesh

    from tests.models.test_parallel import DENSE, EXPERT, _model

    with torch.device("meta"):
        model = _model("qwen3_moe", tied)
    world = dist.get_world_size()
    try:
        parallelize(
            model,
            dense_mesh=init_device_mesh("cpu", dense, mesh_dim_names=DENSE),
            expert_mesh=init_device_mesh("cpu", (1, world, 1), mesh_dim_names=EXPERT),
            config=ParallelConfig(shard_embedding_rows=True),
        )
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize(
    ("dense", "tied", "expected"),
    [
        ((1, 1, 2, 1, 1), True, "tie_word_embeddings = false"),
        ((1, 2, 2, 1, 1), False, "HSDP: mesh.data_replicate > 1"),
        ((1, 1, 2, 1, 2), False, "tensor parallelism (mesh.tensor > 1)"),
    ],
    ids=["tied", "hsdp", "tp"],
)
def test_layouts_it_cannot_apply_to_are_refused_naming_the_key(
    dense: tuple[int, ...], tied: bool, expected: str
) -> None:
    for msg in run_distributed(_refusal, math.prod(dense), dense, tied):
        assert "parallel.shard_embedding_rows" in msg and expected in msg, msg
