"""Qwen3-Next (gated DeltaNet + gated full attention, MoE) layouts on gloo against the
single-process model: FSDP2, EP=2 x FSDP2 and TP=2 (full-attention heads and the dense MLP sharded,
the DeltaNet mixers and the MoE blocks replicated) give its loss and every gradient; context
parallelism is refused by the plan, naming the ``linear_attention`` layer type.

Gradient reduction is by *sum* (the loop's convention: objective = local token-sum loss / global
token count), as in tests/models/test_parallel.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from plait.dist_core import DeviceMeshParameters, DistributedContext
from plait.models import load_hf_checkpoint, parallelize, save_hf_checkpoint
from plait.models.common.linear_attention import GatedDeltaNet
from plait.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3NextConfig
from torch.distributed.tensor import DTensor

dist_testing = pytest.importorskip("plait.dist_core.testing")
run_distributed = dist_testing.run_distributed

# linear / full / linear attention; layer 1 dense (sharded by TP), layers 0 and 2 MoE.
CFG = dict(
    vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, layer_types=["linear_attention", "full_attention", "linear_attention"],
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=6,
    linear_conv_kernel_dim=3, linear_chunk_size=4, moe_intermediate_size=16, shared_expert_intermediate_size=12,
    num_experts=4, num_experts_per_tok=2, mlp_only_layers=[1], router_aux_loss_coef=0.0, initializer_range=0.2,
)  # fmt: skip
# layout -> DistributedContext degrees
LAYOUTS = {
    "fsdp2": {"data_shard": 2},
    "ep2_fsdp2": {"data_shard": 2, "expert": 2},
    "tp2": {"tensor": 2},
}


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 128, (4, 10), generator=g)  # 10 tokens: chunks of 4, 4 and 2
    labels = torch.randint(0, 128, (4, 10), generator=g)
    labels[0, :3] = -100
    return ids, labels


def _rank_main(layout: str, ckpt: str) -> dict:
    from torch.distributed.fsdp import FSDPModule

    degrees = LAYOUTS[layout]
    ctx = DistributedContext.from_env(DeviceMeshParameters(**degrees), device="cpu")
    with torch.device("meta"):
        model = Qwen3_5ForCausalLM(Qwen3NextConfig(**CFG))
    parallelize(model, context=ctx)
    layers = list(model.decoder_layers())
    if layout == "tp2":
        mixer = layers[0].self_attn
        assert isinstance(mixer, GatedDeltaNet)
        assert not any(isinstance(p, DTensor) for p in mixer.parameters())  # replicated
        assert isinstance(layers[1].self_attn.q_proj.weight, DTensor)  # heads sharded
    if "expert" in degrees:
        assert all(isinstance(m.experts.gate_up_proj, DTensor) for m in model.moe_layers())
    model.to_empty(device="cpu")
    model.reset_parameters()
    load_hf_checkpoint(model, ckpt)  # each rank reads its shards
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)  # sum, like plait.loop
            m.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    ids, labels = _batch()
    dp, rank = degrees.get("data_shard", 1), dist.get_rank()
    rows = slice(rank * 4 // dp, (rank + 1) * 4 // dp) if dp > 1 else slice(None)
    out = model(input_ids=ids[rows], labels=labels[rows])
    global_tokens = int((labels != -100).sum())
    (out["loss_sum"] / global_tokens).backward()
    loss_sum = out["loss_sum"].detach().clone()
    if dp > 1:
        dist.all_reduce(loss_sum)
    grads = {n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad.clone()
             for n, p in model.named_parameters()}  # fmt: skip
    ctx.shutdown()
    return {"loss": loss_sum.item() / global_tokens, "grads": grads if rank == 0 else None}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[float, dict[str, torch.Tensor], str]:
    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(Qwen3NextConfig(**CFG))
    model.reset_parameters()
    ckpt = save_hf_checkpoint(model, tmp_path_factory.mktemp("qwen3_next") / "seed")
    ids, labels = _batch()
    out = model(input_ids=ids, labels=labels)
    out["loss"].backward()
    return out["loss"].item(), {n: p.grad for n, p in model.named_parameters()}, str(ckpt)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_layout_matches_single_process(layout, reference):
    ref_loss, ref_grads, ckpt = reference
    results = run_distributed(_rank_main, 2, layout, ckpt, timeout=240.0)
    for r in results:
        assert r["loss"] == pytest.approx(ref_loss, abs=1e-5)
    grads = results[0]["grads"]
    assert set(grads) == set(ref_grads)
    assert any(".self_attn.A_log" in n for n in grads) and any(".self_attn.q_norm" in n for n in grads)
    for name, ref in ref_grads.items():
        torch.testing.assert_close(grads[name], ref, atol=1e-5, rtol=1e-4, msg=name)


def _context_parallel_rank() -> str:
    ctx = DistributedContext.from_env(DeviceMeshParameters(context_shard=2), device="cpu")
    with torch.device("meta"):
        model = Qwen3_5ForCausalLM(Qwen3NextConfig(**CFG))
    try:
        parallelize(model, context=ctx)
    except ValueError as e:
        return str(e)
    finally:
        ctx.shutdown()
    return "no error"


def test_context_parallelism_is_refused_by_the_plan_naming_the_layer_type():
    for msg in run_distributed(_context_parallel_rank, 2):
        assert "context parallelism (mesh.context=2) is not supported by layer 0" in msg, msg
        assert "'linear_attention'" in msg, msg
