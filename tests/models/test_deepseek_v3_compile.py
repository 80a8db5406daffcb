"""A DeepSeek-V3 decoder layer (multi-head latent attention + a MoE block with sigmoid, group-limited
routing, the updated correction bias, shared experts and the sequence-wise balance loss) compiles
as one graph (``fullgraph=True``), forward and backward, and matches eager."""

from __future__ import annotations

import copy

import pytest
import torch
from plait.models.common.attention import build_attention_mask
from plait.models.common.rope import RotaryEmbedding
from plait.models.deepseek_v3 import DeepseekV3Config, deepseek_v3_layer
from torch._dynamo.utils import counters


def _setup(device: str, dtype: torch.dtype, attn: str):
    torch.manual_seed(0)
    cfg = DeepseekV3Config(
        vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
        moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
        n_shared_experts=1, first_k_dense_replace=0, kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=32,
        qk_rope_head_dim=32, v_head_dim=32, bias_update_rate=1e-3, seq_aux_loss_coef=1e-2,
        attn_implementation=attn,
    )  # fmt: skip
    layer = deepseek_v3_layer(cfg, 0).to(device=device, dtype=dtype).train()
    layer.reset_parameters(0.2)
    b, s = 2, 64
    docs = torch.tensor([[0] * 20 + [1] * 30 + [2] * 14, [0] * s], device=device)  # packed row 0
    pos = torch.arange(s, device=device).expand(b, s)
    rope = RotaryEmbedding(cfg.rope_parameters, cfg.rope_head_dim, cfg.max_position_embeddings)(pos, dtype)
    mask = build_attention_mask(b, s, torch.device(device), dtype, document_ids=docs, implementation=attn)
    x = torch.randn(b, s, cfg.hidden_size, device=device, dtype=dtype)
    return layer, x, torch.randn_like(x), rope, mask


def _run(fn, layer, x, g, rope, mask):
    layer.zero_grad()
    xx = x.clone().requires_grad_()
    h, aux, _stats = fn(xx, rope, mask)
    torch.autograd.backward([h, aux], [g, torch.ones_like(aux)])
    return [h.detach(), aux.detach(), xx.grad], {n: p.grad.clone() for n, p in layer.named_parameters()}


def _check(device: str, dtype: torch.dtype, attn: str, backend: str, tol: dict) -> None:
    layer, x, g, rope, mask = _setup(device, dtype, attn)
    compiled_layer = copy.deepcopy(layer)
    counters.clear()
    torch._dynamo.reset()
    compiled = torch.compile(compiled_layer, fullgraph=True, backend=backend)
    got, got_grads = _run(compiled, compiled_layer, x, g, rope, mask)
    assert not counters["graph_break"], dict(counters["graph_break"])
    ref, ref_grads = _run(layer, layer, x, g, rope, mask)
    assert float(ref[1]) > 0  # the sequence-wise balance loss is on and differentiated
    for name, a, b in zip(("hidden", "aux_loss", "dx"), got, ref):
        torch.testing.assert_close(a, b, **tol, msg=lambda m, name=name: f"{name}: {m}")
    assert set(got_grads) == set(ref_grads)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(got_grads[name], grad, **tol, msg=lambda m, name=name: f"{name}: {m}")
    # The bias counters advanced once per forward in both, and the update moves the bias alike.
    assert torch.equal(compiled_layer.mlp.router._bias_counts, layer.mlp.router._bias_counts)
    layer.mlp.update_expert_bias()
    compiled_layer.mlp.update_expert_bias()
    assert torch.equal(compiled_layer.mlp.router.expert_bias, layer.mlp.router.expert_bias)
    assert layer.mlp.router.expert_bias.abs().sum() > 0


def test_deepseek_v3_layer_compiles_fullgraph_on_cpu() -> None:
    # aot_eager: Dynamo + AOTAutograd (both graphs) without Inductor's C++ build.
    # The compiled graph traces RMSNorm's PyTorch formulation, eager runs the custom op: a few fp32
    # gradient elements differ by ~3e-5.
    _check("cpu", torch.float32, "sdpa", "aot_eager", {"atol": 1e-4, "rtol": 1e-3})


@pytest.mark.gpu
@pytest.mark.parametrize("attn", ["sdpa", "flex"])
def test_deepseek_v3_layer_compiles_fullgraph_on_cuda(attn: str) -> None:
    # Inductor; SDPA or FlexAttention (document mask) with v's head size (32) != q/k's (32 + 32).
    _check("cuda", torch.float32, attn, "inductor", {"atol": 1e-4, "rtol": 1e-3})
