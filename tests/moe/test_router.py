"""Router numerics, balancing losses, expert bias and load statistics against hand-written references."""

from __future__ import annotations

import math

import pytest
import torch
from plait.moe import (
    MoELayer,
    RouterConfig,
    TopKRouter,
    attach_aux_loss,
    expert_load_stats,
    register_expert_bias_hook,
)
from pydantic import ValidationError
from torch.utils.checkpoint import checkpoint

H, E = 8, 8


def _ref_route(
    logits: torch.Tensor, bias: torch.Tensor, cfg: RouterConfig
) -> tuple[list[list[int]], list[list[float]]]:
    """Per-token Python reference of sigmoid/softmax, group-limited, biased top-k routing (float64)."""
    idx_out, w_out = [], []
    for row in logits.detach().double():
        scores = torch.sigmoid(row) if cfg.score_func == "sigmoid" else torch.softmax(row, 0)
        sel = [float(s + b) for s, b in zip(scores, bias.double())]
        allowed = list(range(E))
        if cfg.n_groups:
            per = E // cfg.n_groups
            gscores = []
            for g in range(cfg.n_groups):
                vals = sorted(sel[g * per : (g + 1) * per], reverse=True)
                gscores.append(vals[0] if cfg.group_score == "max" else vals[0] + vals[1])
            groups = sorted(range(cfg.n_groups), key=lambda g: -gscores[g])[: cfg.topk_groups]
            allowed = [e for g in groups for e in range(g * per, (g + 1) * per)]
        chosen = sorted(allowed, key=lambda e: -sel[e])[: cfg.top_k]
        w = [float(scores[e]) for e in chosen]
        if cfg.norm_topk_prob:
            s = sum(w)
            w = [v / s for v in w]
        idx_out.append(chosen)
        w_out.append([v * cfg.scaling_factor for v in w])
    return idx_out, w_out


@pytest.mark.parametrize(
    "cfg",
    [
        RouterConfig(
            score_func="sigmoid",
            top_k=3,
            norm_topk_prob=True,
            scaling_factor=2.5,
            n_groups=4,
            topk_groups=2,
            group_score="top2_sum",
            bias_update_rate=0.1,
        ),
        RouterConfig(score_func="softmax", top_k=2, n_groups=2, topk_groups=1, group_score="max"),
        RouterConfig(score_func="sigmoid", top_k=2, bias_update_rate=0.1),
    ],
)
def test_routing_matches_reference(cfg: RouterConfig) -> None:
    torch.manual_seed(0)
    router = TopKRouter(H, E, cfg)
    if router.expert_bias is not None:
        router.expert_bias.copy_(torch.randn(E) * 0.3)
    x = torch.randn(20, H)
    out = router(x)
    bias = router.expert_bias if router.expert_bias is not None else torch.zeros(E)
    ref_idx, ref_w = _ref_route(x @ router.weight.T, bias, cfg)
    assert out.topk_idx.tolist() == ref_idx
    torch.testing.assert_close(
        out.topk_weights.double(), torch.tensor(ref_w, dtype=torch.float64), rtol=1e-5, atol=1e-6
    )


def test_bias_affects_selection_only() -> None:
    torch.manual_seed(1)
    router = TopKRouter(H, E, RouterConfig(score_func="sigmoid", top_k=2, bias_update_rate=0.01))
    router.expert_bias[5] = 100.0  # expert 5 always selected ...
    x = torch.randn(10, H)
    out = router(x)
    assert (out.topk_idx[:, 0] == 5).all()
    # ... but weighted by its unbiased score.
    torch.testing.assert_close(out.topk_weights[:, 0], torch.sigmoid(x @ router.weight[5]))


def test_seq_aux_loss_and_z_loss_hand_computed() -> None:
    torch.manual_seed(2)
    k, coef_seq, coef_z = 2, 0.3, 0.05
    layer = MoELayer(
        H, 4, E, RouterConfig(score_func="sigmoid", top_k=k, seq_aux_loss_coef=coef_seq, z_loss_coef=coef_z)
    )
    x = torch.randn(3, 5, H)
    out = layer(x)
    logits = (x.reshape(-1, H) @ layer.router.weight.T).detach().double()
    scores = torch.sigmoid(logits)
    idx = torch.topk(scores, k, dim=-1).indices
    seq_losses = []
    for b in range(3):
        rows = range(b * 5, (b + 1) * 5)
        total = 0.0
        for i in range(E):
            count = sum(int((idx[t] == i).sum()) for t in rows)
            f = E / (k * 5) * count
            p = sum(float(scores[t, i] / scores[t].sum()) for t in rows) / 5
            total += f * p
        seq_losses.append(total)
    seq_ref = sum(seq_losses) / 3
    z_ref = sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in logits.tolist()) / logits.shape[0]
    torch.testing.assert_close(
        out.losses["seq"].double(), torch.tensor(seq_ref, dtype=torch.float64), rtol=1e-5, atol=1e-6
    )
    torch.testing.assert_close(
        out.losses["z"].double(), torch.tensor(z_ref, dtype=torch.float64), rtol=1e-5, atol=1e-6
    )
    torch.testing.assert_close(
        out.aux_loss.double(),
        torch.tensor(coef_seq * seq_ref + coef_z * z_ref, dtype=torch.float64),
        rtol=1e-5,
        atol=1e-6,
    )
    out.aux_loss.backward()
    assert layer.router.weight.grad is not None and layer.router.weight.grad.abs().sum() > 0


def test_bias_update_rule_and_counting() -> None:
    torch.manual_seed(3)
    rate = 0.05
    layer = MoELayer(H, 4, E, RouterConfig(top_k=2, bias_update_rate=rate))
    xs = [torch.randn(2, 6, H) for _ in range(3)]
    expected = torch.zeros(E, dtype=torch.int64)
    for x in xs:
        expected += layer(x).tokens_per_expert
    layer.eval()
    layer(torch.randn(4, H))  # eval forwards are not counted
    layer.train()
    counts = layer.update_expert_bias()
    assert torch.equal(counts, expected)
    ref = rate * torch.sign(expected.double().mean() - expected.double())
    torch.testing.assert_close(layer.router.expert_bias.double(), ref)
    # No forwards since the update: all counts zero -> no change.
    layer.update_expert_bias()
    torch.testing.assert_close(layer.router.expert_bias.double(), ref)
    assert "router.expert_bias" in layer.state_dict()


def test_bias_hook_runs_after_optimizer_step() -> None:
    torch.manual_seed(4)
    layer = MoELayer(H, 4, E, RouterConfig(top_k=2, bias_update_rate=0.1))
    opt = torch.optim.SGD(layer.parameters(), lr=0.0)
    register_expert_bias_hook(opt, layer)
    out = layer(torch.randn(12, H))
    out.hidden_states.sum().backward()
    assert layer.router.expert_bias.abs().sum() == 0
    opt.step()
    c = out.tokens_per_expert.double()
    torch.testing.assert_close(layer.router.expert_bias.double(), 0.1 * torch.sign(c.mean() - c))


def test_update_without_rate_raises() -> None:
    layer = MoELayer(H, 4, E, RouterConfig(top_k=2))
    with pytest.raises(RuntimeError, match="bias_update_rate"):
        layer.update_expert_bias()


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_recomputation_counted_once(use_reentrant: bool) -> None:
    torch.manual_seed(5)
    layer = MoELayer(H, 4, E, RouterConfig(top_k=2, bias_update_rate=0.1))
    x = torch.randn(10, H, requires_grad=True)
    ref_counts = layer(x).tokens_per_expert
    layer.tokens_per_expert_stats(reset=True)
    layer.router._bias_counts.zero_()

    y = checkpoint(lambda t: layer(t).hidden_states, x, use_reentrant=use_reentrant)
    y.sum().backward()  # re-runs the forward inside backward
    assert torch.equal(layer.tokens_per_expert_stats(reset=False), ref_counts)
    assert torch.equal(layer.router._bias_counts, ref_counts)
    stats = expert_load_stats(layer)
    assert torch.equal(stats["router"], ref_counts)
    assert layer.tokens_per_expert_stats().sum() == 0  # expert_load_stats reset it


def test_config_errors_name_the_field() -> None:
    with pytest.raises(ValidationError, match="n_groups"):
        RouterConfig(top_k=2, n_groups=4)
    with pytest.raises(ValidationError, match="topk_groups"):
        RouterConfig(top_k=2, n_groups=2, topk_groups=3)
    with pytest.raises(ValueError, match="top_k"):
        MoELayer(H, 4, E, RouterConfig(top_k=9))
    with pytest.raises(ValueError, match="n_groups"):
        MoELayer(H, 4, E, RouterConfig(top_k=2, n_groups=3, topk_groups=1))
    with pytest.raises(ValidationError):
        RouterConfig(top_k=2, score_func="relu")  # type: ignore[arg-type]
    with pytest.raises(ValidationError):
        RouterConfig(top_k=0)


def test_attach_aux_loss_equals_adding_it() -> None:
    torch.manual_seed(6)
    layer = MoELayer(H, 4, E, RouterConfig(top_k=2, aux_loss_coef=0.3, z_loss_coef=0.1))
    x = torch.randn(2, 6, H)
    out = layer(x)
    (out.hidden_states.square().sum() + 0.5 * out.aux_loss).backward()
    ref = {n: p.grad.clone() for n, p in layer.named_parameters()}
    layer.zero_grad()
    out = layer(x)
    attach_aux_loss(out.hidden_states, out.aux_loss, scale=0.5).square().sum().backward()
    for n, p in layer.named_parameters():
        torch.testing.assert_close(p.grad, ref[n], msg=n)


def test_padding_left_out_of_losses_and_statistics() -> None:
    """A token mask removes padding from the seq / z losses (hand-computed over the real tokens
    only, float64), the expert counts and the load statistics; padding is still routed and computed."""
    torch.manual_seed(7)
    k, coef_seq, coef_z = 2, 0.3, 0.05
    layer = MoELayer(
        H, 4, E, RouterConfig(score_func="sigmoid", top_k=k, seq_aux_loss_coef=coef_seq, z_loss_coef=coef_z)
    )
    x = torch.randn(3, 5, H)
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1], [1, 1, 0, 0, 0]], dtype=torch.bool)
    out = layer(x, token_mask=mask)
    logits = (x.reshape(-1, H) @ layer.router.weight.T).detach().double()
    scores = torch.sigmoid(logits)
    idx = torch.topk(scores, k, dim=-1).indices
    real = [t for t in range(15) if mask.flatten()[t]]
    seq_losses = []
    for b in range(3):
        rows = [t for t in real if b * 5 <= t < (b + 1) * 5]
        total = 0.0
        for i in range(E):
            f = E / (k * len(rows)) * sum(int((idx[t] == i).sum()) for t in rows)
            p = sum(float(scores[t, i] / scores[t].sum()) for t in rows) / len(rows)
            total += f * p
        seq_losses.append(total)
    seq_ref = sum(seq_losses) / 3
    z_ref = sum(math.log(sum(math.exp(v) for v in logits[t].tolist())) ** 2 for t in real) / len(real)
    for name, ref in (("seq", seq_ref), ("z", z_ref)):
        torch.testing.assert_close(
            out.losses[name].double(), torch.tensor(ref, dtype=torch.float64), rtol=1e-5, atol=1e-6
        )
    counts = torch.bincount(idx[real].flatten(), minlength=E)
    assert torch.equal(out.tokens_per_expert, counts)
    assert torch.equal(layer.tokens_per_expert_stats(), counts)
    torch.testing.assert_close(out.hidden_states, layer(x).hidden_states)  # padding still computed
    with pytest.raises(ValueError, match="token_mask"):
        layer(x, token_mask=mask[:, :4])


def test_all_layers_pooling_returns_statistics_instead_of_the_switch_loss() -> None:
    torch.manual_seed(8)
    cfg = {"top_k": 2, "aux_loss_coef": 0.1, "z_loss_coef": 0.01}
    per_layer = MoELayer(H, 4, E, RouterConfig(**cfg))
    pooled = MoELayer(H, 4, E, RouterConfig(**cfg, aux_loss_pooling="all_layers"))
    pooled.load_state_dict(per_layer.state_dict())
    x = torch.randn(2, 6, H)
    a, b = per_layer(x), pooled(x)
    torch.testing.assert_close(b.aux_loss, 0.01 * a.losses["z"])  # only the z-loss is left in aux_loss
    torch.testing.assert_close(a.aux_loss, 0.1 * a.losses["switch"] + 0.01 * a.losses["z"])
    assert b.switch_stats is not None and b.switch_stats.shape == (2 * E + 1,)
    assert b.switch_stats.requires_grad and float(b.switch_stats[-1]) == 12.0
    assert MoELayer(H, 4, E, RouterConfig(top_k=2))(x).switch_stats is None  # no Switch loss asked
