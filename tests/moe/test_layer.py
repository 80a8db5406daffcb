"""Local MoELayer edge cases against the float64 loop reference: dropping, empty experts, one hot expert."""

from __future__ import annotations

import pytest
import torch
from plait.moe import MoELayer, RouterConfig, apply_capacity, expert_capacity

from ._reference import kept_assignments, reference_moe

H, FFN, E = 8, 6, 8


def _check_against_reference(layer: MoELayer, x: torch.Tensor, **ref_kwargs: object) -> None:
    params = {k: v.detach().double().requires_grad_() for k, v in layer.named_parameters()}
    x64 = x.double().requires_grad_()
    y_ref, aux_ref, counts_ref = reference_moe(x64, params, **ref_kwargs)  # type: ignore[arg-type]
    g = torch.randn_like(y_ref)
    ((y_ref * g).sum() + aux_ref).backward()

    xx = x.clone().requires_grad_()
    out = layer(xx)
    ((out.hidden_states * g.float()).sum() + out.aux_loss).backward()
    torch.testing.assert_close(out.hidden_states.double(), y_ref.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.aux_loss.double(), aux_ref.detach(), rtol=1e-5, atol=1e-6)
    assert torch.equal(out.tokens_per_expert, counts_ref)
    torch.testing.assert_close(xx.grad.double(), x64.grad, rtol=1e-5, atol=1e-5)
    for name, p in layer.named_parameters():
        torch.testing.assert_close(p.grad.double(), params[name].grad, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_capacity_dropping(policy: str) -> None:
    torch.manual_seed(0)
    layer = MoELayer(
        H, FFN, E, RouterConfig(top_k=2, aux_loss_coef=0.1), capacity_factor=0.5, drop_policy=policy
    )  # type: ignore[arg-type]
    x = torch.randn(24, H)
    # The limit binds: some assignments are dropped.
    with torch.no_grad():
        r = layer.router(x)
    kept = kept_assignments(r.topk_idx, r.topk_weights, E, 0.5, policy)
    assert not kept.all()
    dropped_idx = apply_capacity(r.topk_idx, r.topk_weights, E, 0.5, policy)  # type: ignore[arg-type]
    assert torch.equal(dropped_idx == E, ~kept)
    assert expert_capacity(24, 2, E, 0.5) == 3
    _check_against_reference(layer, x, top_k=2, aux_loss_coef=0.1, capacity_factor=0.5, drop_policy=policy)


def test_empty_experts_get_zero_grad() -> None:
    torch.manual_seed(1)
    layer = MoELayer(H, FFN, E, RouterConfig(top_k=1, norm_topk_prob=True))
    x = torch.randn(3, H)  # 3 tokens, top-1: at least 5 of 8 experts are empty
    _check_against_reference(layer, x, top_k=1, norm_topk_prob=True)
    used = layer(x).tokens_per_expert > 0
    assert (~used).sum() >= 5
    assert layer.experts.gate_up_proj.grad[~used].abs().sum() == 0


def test_all_tokens_to_one_expert_with_shared_expert() -> None:
    torch.manual_seed(2)
    layer = MoELayer(
        H, FFN, E, RouterConfig(top_k=2), shared_expert_intermediate_size=5, shared_expert_gate=True
    )
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[3, 0] = 20.0
    x = torch.randn(16, H)
    x[:, 0] = x[:, 0].abs() + 1.0
    out = layer(x)
    assert out.tokens_per_expert[3] == 16
    _check_against_reference(layer, x, top_k=2)


def test_capacity_one_hot_expert_keeps_capacity_rows() -> None:
    torch.manual_seed(3)
    layer = MoELayer(H, FFN, E, RouterConfig(top_k=1), capacity_factor=1.0, drop_policy="position")
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[2, 0] = 20.0
    x = torch.randn(16, H)
    x[:, 0] = x[:, 0].abs() + 1.0
    y = layer(x).hidden_states
    # capacity = 16 * 1 / 8 = 2: only the first two tokens are computed; the rest get zero.
    assert y[:2].abs().sum() > 0 and y[2:].abs().sum() == 0
    _check_against_reference(layer, x, top_k=1, capacity_factor=1.0, drop_policy="position")


def test_bad_inputs() -> None:
    with pytest.raises(ValueError, match="capacity_factor"):
        MoELayer(H, FFN, E, RouterConfig(top_k=2), capacity_factor=0.0)
    with pytest.raises(ValueError, match="drop_policy"):
        MoELayer(H, FFN, E, RouterConfig(top_k=2), drop_policy="random")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="shared_expert_gate"):
        MoELayer(H, FFN, E, RouterConfig(top_k=2), shared_expert_gate=True)
    with pytest.raises(ValueError, match="hidden_size"):
        MoELayer(H, FFN, E, RouterConfig(top_k=2))(torch.randn(4, H + 1))


@pytest.mark.gpu
def test_cuda_matches_cpu() -> None:
    """CUDA path (Triton SwiGLU and gather-sum combine, torch grouped GEMM) equals the CPU path."""
    torch.manual_seed(4)
    layer = MoELayer(H, FFN, E, RouterConfig(top_k=2), capacity_factor=0.75)
    x = torch.randn(10, H)

    def run(device: str) -> list[torch.Tensor]:
        layer.to(device).zero_grad()
        xx = x.to(device, copy=True).requires_grad_()  # a fresh leaf on each device (x stays grad-free)
        y = layer(xx).hidden_states
        (y * torch.arange(H, device=device)).sum().backward()
        # Copies: the next layer.to(device) moves the parameters' .grad tensors in place.
        return [t.detach().to("cpu", copy=True) for t in (y, xx.grad, layer.experts.down_proj.grad)]

    ref = run("cpu")
    for a, b in zip(run("cuda"), ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("capacity_factor", [None, 0.75])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_forward_backward_has_no_host_sync(capacity_factor: float | None, dtype: torch.dtype) -> None:
    """Router, permute, grouped GEMM (torch._grouped_mm in bf16 on Hopper, plait's Triton kernel
    otherwise), SwiGLU, unpermute: no device-to-host sync, dropless or with capacity dropping (the
    permuted buffer has a static size)."""
    torch.manual_seed(5)
    layer = MoELayer(64, 32, 8, RouterConfig(top_k=2), capacity_factor=capacity_factor)
    layer = layer.to(device="cuda", dtype=dtype).train()
    x = torch.randn(4, 96, 64, device="cuda", dtype=dtype, requires_grad=True)

    def step() -> None:
        out = layer(x)
        (out.hidden_states.float().square().sum() + out.aux_loss).backward()

    step()  # warm-up: Triton compiles its kernels on first use
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert torch.isfinite(layer.experts.down_proj.grad).all()


def test_meta_init_then_reset_parameters() -> None:
    with torch.device("meta"):
        layer = MoELayer(
            H, FFN, E, RouterConfig(top_k=2, bias_update_rate=0.1), shared_expert_intermediate_size=4
        )
    layer.to_empty(device="cpu")
    layer.reset_parameters()
    assert layer.router.expert_bias.abs().sum() == 0 and layer.tokens_per_expert_stats().sum() == 0
    out = layer(torch.randn(5, H))
    assert torch.isfinite(out.hidden_states).all()
    assert layer.tokens_per_expert_stats().sum() == 10


def test_bf16_expert_bias_gradients_accumulate_in_fp32() -> None:
    # Each expert's bias gradient sums thousands of rows: in bf16 every add would round to 8 bits
    # (and on CUDA in an order that changes run to run). Against the float64 sum of the same rows.
    from plait.moe import ClampedSwiGLU, GroupedExperts

    torch.manual_seed(0)
    experts = GroupedExperts(2, 16, 8, activation=ClampedSwiGLU(), bias=True)
    experts.reset_parameters()
    experts.to(torch.bfloat16)
    rows = 4096
    x = torch.randn(rows, 16, dtype=torch.bfloat16)
    counts = torch.tensor([rows // 2, rows // 2])
    g = torch.randn(rows, 16, dtype=torch.bfloat16) + 1.0  # a non-zero mean: large sums
    experts(x, counts).backward(g)
    want = g.double().view(2, rows // 2, 16).sum(1)
    got = experts.down_proj_bias.grad.double()
    assert torch.allclose(got, want, rtol=8e-3, atol=0.0), (got - want).abs().max()
