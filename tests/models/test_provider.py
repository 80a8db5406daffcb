"""The training-loop provider and FLOP accounting."""

from __future__ import annotations

import pytest
import torch
from plait.models import CausalLMProvider, flops_per_token
from plait.models.qwen3 import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig

MOE = dict(
    vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
    mlp_only_layers=(1,),
)  # fmt: skip


def _counted(model: Qwen3ForCausalLM, cfg: Qwen3MoeConfig) -> int:
    """Matmul parameters per token, counted from the module: experts scaled by top_k / E."""
    total = 0
    for name, p in model.named_parameters():
        if "norm" in name or "embed_tokens" in name:
            continue
        n = p.numel()
        if ".experts." in name:
            n = n * cfg.num_experts_per_tok // cfg.num_experts
        total += n
    return total


def test_active_params_and_flops():
    cfg = Qwen3MoeConfig(**MOE)
    with torch.device("meta"):
        model = Qwen3ForCausalLM(cfg)
    attn = 12 * 3 * 4 * 8 * 128  # layers x heads x head_dim x seq_len
    assert flops_per_token(cfg, 128) == 6 * _counted(model, cfg) + attn
    dense = Qwen3Config(**{k: v for k, v in MOE.items() if k in Qwen3Config.model_fields})
    with torch.device("meta"):
        dmodel = Qwen3ForCausalLM(dense)
    n = sum(p.numel() for k, p in dmodel.named_parameters() if "norm" not in k and "embed" not in k)
    assert flops_per_token(dense, 128) == 6 * n + attn


def test_provider_stages_materialize_and_protocol():
    loop_providers = pytest.importorskip("plait.loop.providers")
    cfg = Qwen3MoeConfig(**MOE)
    provider = CausalLMProvider(cfg, seed=3)
    assert isinstance(provider, loop_providers.ModelProvider)
    stages = [provider.build_stage(s, 2) for s in range(2)]
    assert all(p.is_meta for st in stages for p in st.parameters())
    for st in stages:
        assert provider.parallelize(st, None, None) is st
        provider.materialize(st, torch.device("cpu"))
    again = provider.build_stage(0, 2)
    provider.materialize(again, torch.device("cpu"))
    for (n, a), (_, b) in zip(stages[0].named_parameters(), again.named_parameters(), strict=True):
        assert torch.equal(a, b), n  # seeded init: every rank draws the same weights
    assert len(CausalLMProvider.moe_layers(stages)) == 2
    assert provider.flops_per_token(64) == flops_per_token(cfg, 64)


def test_lm_head_is_a_one_pass_loss_the_loop_switches_under_gpipe():
    """The loop's engine reaches the head of a real stage through ``OnePassLoss``: a default head
    switches to two passes under GPipe (4 forwards in flight), an explicit choice is kept."""
    loop_providers = pytest.importorskip("plait.loop.providers")
    engine = pytest.importorskip("plait.loop.engine")
    from plait.models.common.heads import LMHead
    from plait.pipelining import build_program

    assert isinstance(LMHead(8, 16), loop_providers.OnePassLoss)
    gpipe = build_program({"kind": "gpipe", "num_microbatches": 4}, 2)
    one_f_one_b = build_program({"kind": "1f1b", "num_microbatches": 4}, 2)
    provider = CausalLMProvider(
        Qwen3Config(**{k: v for k, v in MOE.items() if k in Qwen3Config.model_fields})
    )
    for program, explicit, expected in ((gpipe, None, False), (one_f_one_b, None, None), (gpipe, True, True)):
        stage = provider.build_stage(1, 2)
        heads = [m for m in stage.modules() if isinstance(m, LMHead)]
        assert len(heads) == 1
        heads[0].grad_in_forward = explicit
        engine._bound_loss_gradients({1: stage}, program, 1)
        assert heads[0].grad_in_forward is expected


def _initial_weights(mesh: dict[str, int] | None, device: str = "cpu") -> dict[str, torch.Tensor]:
    """The Qwen3-MoE above built, parallelized over ``mesh`` (None: one process), materialised on
    ``device`` (``"cpu"``: gloo; ``"cuda"``: NCCL, the rank's GPU): full tensors, on the CPU."""
    from plait.dist_core import DeviceMeshParameters, DistributedContext
    from torch.distributed.tensor import DTensor

    ctx = DistributedContext.from_env(DeviceMeshParameters(**mesh), device=device) if mesh else None
    provider = CausalLMProvider(Qwen3MoeConfig(**MOE), seed=3)
    stage = provider.build_stage(0, 1)
    provider.parallelize(stage, ctx)
    provider.materialize(stage, ctx.device if ctx else device)
    return {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu()
        for n, p in stage.named_parameters()
    }


@pytest.mark.parametrize(
    "mesh",
    [{"data_shard": 2}, {"data_shard": 2, "expert": 2}, {"tensor": 2}, {"data_replicate": 2}],
    ids=["fsdp", "ep_x_fsdp", "tp", "replicate"],
)
def test_a_sharded_model_starts_from_one_process_initial_weights(mesh: dict[str, int]) -> None:
    """On CPU meshes, where torch draws each shard's random numbers as if it were the whole tensor (the
    shards of a weight would repeat each other), every rank holds its part of one process's values."""
    from plait.dist_core.testing import run_distributed

    want = _initial_weights(None)
    for weights in run_distributed(_initial_weights, 2, mesh):
        assert weights.keys() == want.keys()
        for name, w in want.items():
            assert torch.equal(weights[name], w), name


@pytest.mark.multigpu
@pytest.mark.parametrize(
    "mesh",
    [{"data_shard": 2}, {"data_shard": 2, "expert": 2}, {"tensor": 2}],
    ids=["fsdp", "ep_x_fsdp", "tp"],
)
def test_cuda_shards_of_a_weight_do_not_repeat(mesh: dict[str, int]) -> None:
    """On CUDA meshes (NCCL, 2 GPUs) torch draws each shard's own part of the random numbers: no two halves
    of a randomly initialised weight are equal, along either sharded dimension."""
    from plait.dist_core.testing import run_distributed

    ranks = run_distributed(_initial_weights, 2, mesh, "cuda", backend="nccl", timeout=300.0)
    for name, w in ranks[0].items():
        assert torch.equal(w, ranks[1][name]), name  # every rank holds the same model
        if w.unique().numel() == 1:  # a norm's ones
            continue
        for dim in range(w.dim()):
            if w.shape[dim] % 2 == 0:
                a, b = w.chunk(2, dim)
                assert not torch.equal(a, b), (name, dim)
