"""MoELayer against transformers' gpt-oss and DeepSeek-V3 MoE blocks (fp32, tiny odd random configs).

The HF block is built with random weights, copied into the plait layer (gpt-oss through the layout
conversion of ``plait.moe``), and outputs, input gradients and every weight gradient are compared.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from plait.moe import (
    ClampedSwiGLU,
    MoELayer,
    RouterConfig,
    down_from_input_major,
    gate_up_bias_from_interleaved,
    gate_up_from_input_major_interleaved,
    switch_aux_loss_from_stats,
    update_expert_biases,
)
from transformers import DeepseekV3Config, GptOssConfig
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP, load_balancing_loss_func

H, FFN, B, S = 12, 10, 2, 7
ATOL = 1e-5


def _randomise(module: torch.nn.Module, seed: int, scale: float) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * scale)


def _run(module: torch.nn.Module, x: torch.Tensor, g: torch.Tensor, plait: bool) -> tuple[torch.Tensor, ...]:
    x = x.clone().requires_grad_()
    out = module(x)
    y = out.hidden_states if plait else (out[0] if isinstance(out, tuple) else out)
    (y * g).sum().backward()
    assert x.grad is not None
    return y.detach(), x.grad


GPT_OSS_CONVERT: dict[str, tuple[str, Callable[[torch.Tensor], torch.Tensor]]] = {
    # HF name -> (plait name, HF tensor -> plait tensor); gradients convert the same way.
    "router.weight": ("router.weight", lambda t: t),
    "router.bias": ("router.bias", lambda t: t),
    "experts.gate_up_proj": ("experts.gate_up_proj", gate_up_from_input_major_interleaved),
    "experts.gate_up_proj_bias": ("experts.gate_up_proj_bias", gate_up_bias_from_interleaved),
    "experts.down_proj": ("experts.down_proj", down_from_input_major),
    "experts.down_proj_bias": ("experts.down_proj_bias", lambda t: t),
}


@pytest.mark.parametrize(("num_experts", "top_k", "limit"), [(6, 3, 1.5), (5, 2, 7.0)])
def test_matches_gpt_oss_mlp(num_experts: int, top_k: int, limit: float) -> None:
    cfg = GptOssConfig(
        hidden_size=H,
        intermediate_size=FFN,
        num_local_experts=num_experts,
        num_experts_per_tok=top_k,
        swiglu_limit=limit,
    )
    hf = GptOssMLP(cfg)
    _randomise(hf, seed=num_experts, scale=0.8)
    ours = MoELayer(
        H,
        FFN,
        num_experts,
        RouterConfig(score_func="softmax_over_topk", logit_bias=True, top_k=top_k),
        expert_activation=ClampedSwiGLU(alpha=cfg.swiglu_alpha, limit=cfg.swiglu_limit),
        expert_proj_bias=True,
    )
    params = dict(ours.named_parameters())
    assert set(params) == {name for name, _ in GPT_OSS_CONVERT.values()}
    with torch.no_grad():
        for hf_name, (name, convert) in GPT_OSS_CONVERT.items():
            params[name].copy_(convert(hf.get_parameter(hf_name)))

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(B, S, H, generator=gen) * 2.0
    grad_out = torch.randn(B, S, H, generator=gen)
    # The clamps bind on part of the activations (so the test sees the clamped branch and its zero gradient).
    h = (
        x.reshape(-1, H) @ params["experts.gate_up_proj"][0].T.detach()
        + params["experts.gate_up_proj_bias"][0]
    )
    assert (h[:, :FFN] > limit).any() and (h[:, FFN:].abs() > limit).any() and (h.abs() < limit).any()

    y_hf, gx_hf = _run(hf, x, grad_out, plait=False)
    y, gx = _run(ours, x, grad_out, plait=True)
    torch.testing.assert_close(y, y_hf, atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(gx, gx_hf, atol=ATOL, rtol=1e-5)
    for hf_name, (name, convert) in GPT_OSS_CONVERT.items():
        hf_grad = hf.get_parameter(hf_name).grad
        assert hf_grad is not None and params[name].grad is not None
        torch.testing.assert_close(params[name].grad, convert(hf_grad), atol=ATOL, rtol=1e-5, msg=name)


def test_gpt_oss_pooled_switch_loss_matches_hf() -> None:
    """With ``aux_loss_pooling="all_layers"`` the Switch statistics of two layers give transformers'
    gpt-oss ``load_balancing_loss_func`` of the two routers' logits (softmax over all experts)."""
    cfg = RouterConfig(
        score_func="softmax_over_topk",
        logit_bias=True,
        top_k=3,
        aux_loss_coef=0.02,
        aux_loss_pooling="all_layers",
    )
    torch.manual_seed(4)
    layers = [
        MoELayer(H, FFN, 6, cfg, expert_activation=ClampedSwiGLU(), expert_proj_bias=True) for _ in range(2)
    ]
    h = torch.randn(B, S, H)
    stats, logits = [], []
    for layer in layers:
        logits.append(layer.router(h.reshape(-1, H)).logits)
        out = layer(h)
        stats.append(out.switch_stats)
        h = out.hidden_states
    expected = load_balancing_loss_func(tuple(logits), num_experts=6, top_k=3)
    torch.testing.assert_close(
        switch_aux_loss_from_stats(stats[0] + stats[1]), expected, rtol=1e-5, atol=1e-6
    )


def _deepseek(
    num_experts: int, top_k: int, n_group: int, topk_group: int, n_shared: int, norm: bool, seed: int
) -> tuple[DeepseekV3MoE, MoELayer]:
    cfg = DeepseekV3Config(
        hidden_size=H,
        moe_intermediate_size=FFN,
        n_routed_experts=num_experts,
        num_experts_per_tok=top_k,
        n_group=n_group,
        topk_group=topk_group,
        n_shared_experts=n_shared,
        norm_topk_prob=norm,
        routed_scaling_factor=2.5,
    )
    hf = DeepseekV3MoE(cfg)
    _randomise(hf, seed=seed, scale=0.5)
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed + 100)
        hf.gate.e_score_correction_bias.copy_(torch.randn(num_experts, generator=g) * 0.5)
    router = RouterConfig(
        score_func="sigmoid",
        fp32_logits=True,
        top_k=top_k,
        norm_topk_prob=norm,
        scaling_factor=2.5,
        n_groups=n_group,
        topk_groups=topk_group,
        group_score="top2_sum",
        selection_bias=True,
    )
    ours = MoELayer(H, FFN, num_experts, router, shared_expert_intermediate_size=FFN * n_shared)
    ours.load_state_dict(_deepseek_to_plait(hf.state_dict()))
    return hf, ours


def _deepseek_to_plait(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    renames = {"gate.weight": "router.weight", "gate.e_score_correction_bias": "router.expert_bias"}
    return {renames.get(k, k.replace("shared_experts.", "shared_expert.")): v for k, v in sd.items()}


@pytest.mark.parametrize(
    ("num_experts", "top_k", "n_group", "topk_group", "n_shared", "norm"),
    [(12, 3, 4, 2, 2, True), (15, 4, 5, 2, 1, False), (8, 2, 1, 1, 1, True)],
)
def test_matches_deepseek_v3_moe(
    num_experts: int, top_k: int, n_group: int, topk_group: int, n_shared: int, norm: bool
) -> None:
    hf, ours = _deepseek(num_experts, top_k, n_group, topk_group, n_shared, norm, seed=num_experts)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(B, S, H, generator=gen)
    grad_out = torch.randn(B, S, H, generator=gen)

    # The correction bias changes which experts are picked, and the groups restrict the choice.
    with torch.no_grad():
        scores = torch.sigmoid(x.reshape(-1, H) @ hf.gate.weight.T)
        picked = ours.router(x.reshape(-1, H)).topk_idx.sort(dim=-1).values
        unbiased = scores.topk(top_k, dim=-1).indices.sort(dim=-1).values
        assert (picked != unbiased).any(dim=-1).float().mean() > 0.2
        if topk_group < n_group:
            biased = (
                (scores + hf.gate.e_score_correction_bias).topk(top_k, dim=-1).indices.sort(dim=-1).values
            )
            assert (picked != biased).any()

    y_hf, gx_hf = _run(hf, x, grad_out, plait=False)
    y, gx = _run(ours, x, grad_out, plait=True)
    torch.testing.assert_close(y, y_hf, atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(gx, gx_hf, atol=ATOL, rtol=1e-5)
    hf_grads = _deepseek_to_plait({n: p.grad for n, p in hf.named_parameters() if p.grad is not None})
    ours_grads = {n: p.grad for n, p in ours.named_parameters()}
    assert set(hf_grads) == set(ours_grads)
    for name, grad in ours_grads.items():
        assert grad is not None
        torch.testing.assert_close(grad, hf_grads[name], atol=ATOL, rtol=1e-5, msg=name)


def test_fixed_selection_bias_loads_and_saves_like_hf() -> None:
    """``selection_bias=True`` without a rate: a persistent buffer (HF's e_score_correction_bias),
    round-tripped through the state dict, used for selection, and not updatable."""
    hf, ours = _deepseek(8, 2, 4, 2, 1, True, seed=3)
    sd = ours.state_dict()
    assert torch.equal(sd["router.expert_bias"], hf.gate.e_score_correction_bias)
    assert ours.router.config.bias_update_rate is None and ours.router.config.has_selection_bias
    with pytest.raises(RuntimeError, match="bias_update_rate"):
        ours.update_expert_bias()
    ours(torch.randn(5, H))
    assert update_expert_biases(ours) == 0  # a fixed bias is left alone by the model-level update
    assert torch.equal(ours.router.expert_bias, hf.gate.e_score_correction_bias)
    fresh = MoELayer(H, FFN, 8, RouterConfig(top_k=2, score_func="sigmoid", selection_bias=True))
    assert "router.expert_bias" in fresh.state_dict()  # persistent even without a rate
    assert "router.expert_bias" not in MoELayer(H, FFN, 8, RouterConfig(top_k=2)).state_dict()
