"""MoELayer against Hugging Face's Qwen3-MoE / Qwen2-MoE sparse blocks (fp32, tiny random configs)."""

from __future__ import annotations

import pytest
import torch
from plait.moe import (
    MoELayer,
    RouterConfig,
    TopKRouter,
    switch_aux_loss,
    switch_aux_loss_from_stats,
    switch_loss_stats,
)
from transformers import Qwen2MoeConfig, Qwen3MoeConfig
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock, load_balancing_loss_func

H, FFN, E, K = 16, 8, 6, 2


def _init(module: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def _grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in module.named_parameters()}


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_matches_qwen3_moe_block(norm_topk_prob: bool) -> None:
    cfg = Qwen3MoeConfig(
        hidden_size=H,
        moe_intermediate_size=FFN,
        num_experts=E,
        num_experts_per_tok=K,
        norm_topk_prob=norm_topk_prob,
    )
    cfg._experts_implementation = "eager"
    hf = Qwen3MoeSparseMoeBlock(cfg)
    _init(hf, 0)
    ours = MoELayer(H, FFN, E, RouterConfig(top_k=K, norm_topk_prob=norm_topk_prob))
    missing = ours.load_state_dict(
        {
            "router.weight": hf.gate.weight,
            "experts.gate_up_proj": hf.experts.gate_up_proj,
            "experts.down_proj": hf.experts.down_proj,
        }
    )
    assert not missing.missing_keys and not missing.unexpected_keys

    x = torch.randn(3, 7, H, generator=torch.Generator().manual_seed(1))
    x_hf, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_hf = hf(x_hf)
    out = ours(x_ours)
    torch.testing.assert_close(out.hidden_states, y_hf, rtol=1e-5, atol=1e-5)
    assert out.aux_loss.item() == 0.0

    g = torch.randn_like(y_hf)
    y_hf.backward(g)
    out.hidden_states.backward(g)
    torch.testing.assert_close(x_ours.grad, x_hf.grad, rtol=1e-5, atol=1e-5)
    ref, got = _grads(hf), _grads(ours)
    torch.testing.assert_close(got["router.weight"], ref["gate.weight"], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got["experts.gate_up_proj"], ref["experts.gate_up_proj"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got["experts.down_proj"], ref["experts.down_proj"], rtol=1e-5, atol=1e-5)

    # Same choices -> same per-expert counts as HF's router.
    _, _, idx = hf.gate(x.view(-1, H))
    assert torch.equal(out.tokens_per_expert, torch.bincount(idx.flatten(), minlength=E))


def test_matches_qwen2_moe_block_with_gated_shared_expert() -> None:
    cfg = Qwen2MoeConfig(
        hidden_size=H,
        moe_intermediate_size=FFN,
        shared_expert_intermediate_size=12,
        num_experts=E,
        num_experts_per_tok=K,
        norm_topk_prob=False,
    )
    cfg._experts_implementation = "eager"
    hf = Qwen2MoeSparseMoeBlock(cfg)
    _init(hf, 2)
    ours = MoELayer(
        H, FFN, E, RouterConfig(top_k=K), shared_expert_intermediate_size=12, shared_expert_gate=True
    )
    sd = {("router.weight" if k == "gate.weight" else k): v for k, v in hf.state_dict().items()}
    result = ours.load_state_dict(sd)
    assert not result.missing_keys and not result.unexpected_keys
    x = torch.randn(2, 5, H, generator=torch.Generator().manual_seed(3), requires_grad=True)
    y_hf = hf(x)
    (gx_hf,) = torch.autograd.grad(y_hf.square().sum(), x)
    y = ours(x).hidden_states
    (gx,) = torch.autograd.grad(y.square().sum(), x)
    torch.testing.assert_close(y, y_hf, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gx, gx_hf, rtol=1e-5, atol=1e-5)


def test_switch_loss_matches_hf_load_balancing_loss_func() -> None:
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(40, E, generator=g) * 2
    ref = load_balancing_loss_func((logits,), num_experts=E, top_k=K)
    probs = torch.softmax(logits, dim=-1)
    idx = torch.topk(probs, K, dim=-1).indices
    torch.testing.assert_close(switch_aux_loss(probs, idx, E), ref, rtol=1e-6, atol=1e-6)

    # And through the layer: the aux loss is coef * HF's loss of the layer's router logits.
    layer = MoELayer(H, FFN, E, RouterConfig(top_k=K, aux_loss_coef=0.01))
    x = torch.randn(2, 10, H, generator=g)
    out = layer(x)
    router_logits = x.view(-1, H) @ layer.router.weight.T
    expected = 0.01 * load_balancing_loss_func((router_logits,), num_experts=E, top_k=K)
    torch.testing.assert_close(out.aux_loss, expected, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(out.losses["switch"], expected / 0.01, rtol=1e-5, atol=1e-6)
    assert out.aux_loss.requires_grad


@pytest.mark.parametrize("padded", [False, True])
def test_pooled_switch_statistics_match_hf_over_layers(padded: bool) -> None:
    """Switch statistics of 3 layers, summed, give HF's load_balancing_loss_func of the 3 layers' logits
    (it pools all layers into one loss), with HF's attention_mask leaving padding out; one layer's
    masked switch_aux_loss is HF's loss of that layer alone."""
    g = torch.Generator().manual_seed(9)
    b, s = 3, 7
    mask = torch.ones(b, s, dtype=torch.long)
    if padded:
        mask[0, :3] = 0  # left padding
        mask[2, 5:] = 0  # right padding
    hf_mask = mask if padded else None
    token_mask = mask.flatten().bool()
    logits = tuple(torch.randn(b * s, E, generator=g) * 2 for _ in range(3))
    stats = []
    for layer_logits in logits:
        probs = torch.softmax(layer_logits, dim=-1)
        idx = torch.topk(probs, K, dim=-1).indices
        stats.append(switch_loss_stats(probs, idx, E, token_mask))
        ref_one = load_balancing_loss_func((layer_logits,), num_experts=E, top_k=K, attention_mask=hf_mask)
        torch.testing.assert_close(switch_aux_loss(probs, idx, E, token_mask), ref_one, rtol=1e-6, atol=1e-6)
    ref = load_balancing_loss_func(logits, num_experts=E, top_k=K, attention_mask=hf_mask)
    torch.testing.assert_close(switch_aux_loss_from_stats(sum(stats)), ref, rtol=1e-6, atol=1e-6)
    # The pooled loss is not the sum (nor the mean) of the per-layer losses.
    per_layer = sum(switch_aux_loss_from_stats(st) for st in stats)
    assert abs(float(per_layer) - float(ref)) > 0.5

    # Through MoE layers with aux_loss_pooling="all_layers": the routers return the statistics.
    layers = [MoELayer(H, FFN, E, RouterConfig(top_k=K, aux_loss_coef=0.01, aux_loss_pooling="all_layers"))]
    layers.append(
        MoELayer(H, FFN, E, RouterConfig(top_k=K, aux_loss_coef=0.01, aux_loss_pooling="all_layers"))
    )
    x = torch.randn(b, s, H, generator=g)
    outs, router_logits = [], []
    for layer in layers:
        router_logits.append(x.reshape(-1, H) @ layer.router.weight.T)
        outs.append(layer(x, token_mask=mask.bool()))
        x = outs[-1].hidden_states
    assert all(float(o.aux_loss) == 0.0 for o in outs)
    pooled = switch_aux_loss_from_stats(sum(o.switch_stats for o in outs))
    expected = load_balancing_loss_func(tuple(router_logits), num_experts=E, top_k=K, attention_mask=hf_mask)
    torch.testing.assert_close(pooled, expected, rtol=1e-5, atol=1e-6)


def test_bf16_close_to_hf() -> None:
    cfg = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=FFN, num_experts=E, num_experts_per_tok=K)
    cfg._experts_implementation = "eager"
    hf = Qwen3MoeSparseMoeBlock(cfg)
    _init(hf, 5)
    ours = MoELayer(H, FFN, E, RouterConfig(top_k=K))
    ours.load_state_dict(
        {
            "router.weight": hf.gate.weight,
            "experts.gate_up_proj": hf.experts.gate_up_proj,
            "experts.down_proj": hf.experts.down_proj,
        }
    )
    x = torch.randn(2, 9, H, generator=torch.Generator().manual_seed(6))
    hf.to(torch.bfloat16)
    ours.to(torch.bfloat16)
    y = ours(x.bfloat16()).hidden_states
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, hf(x.bfloat16()), rtol=2e-2, atol=2e-2)


def test_group_limited_sigmoid_router_matches_deepseek_v3() -> None:
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    n_exp, k = 16, 4
    cfg = DeepseekV3Config(
        hidden_size=H,
        n_routed_experts=n_exp,
        num_experts_per_tok=k,
        n_group=4,
        topk_group=2,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
    )
    hf = DeepseekV3TopkRouter(cfg)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(hf.weight.shape, generator=g))
        hf.e_score_correction_bias.copy_(torch.randn(n_exp, generator=g) * 0.2)
    ours = TopKRouter(
        H,
        n_exp,
        RouterConfig(
            score_func="sigmoid",
            top_k=k,
            norm_topk_prob=True,
            scaling_factor=2.5,
            n_groups=4,
            topk_groups=2,
            group_score="top2_sum",
            bias_update_rate=1e-3,
        ),
    )
    ours.load_state_dict({"weight": hf.weight, "expert_bias": hf.e_score_correction_bias})
    x = torch.randn(32, H, generator=g)
    _, w_hf, idx_hf = hf(x)
    out = ours(x)
    # HF returns the top-k unsorted: compare as sets, weights matched by expert.
    order_hf, order_ours = idx_hf.argsort(dim=-1), out.topk_idx.argsort(dim=-1)
    assert torch.equal(idx_hf.gather(1, order_hf), out.topk_idx.gather(1, order_ours))
    torch.testing.assert_close(
        out.topk_weights.gather(1, order_ours), w_hf.gather(1, order_hf), rtol=1e-5, atol=1e-6
    )
