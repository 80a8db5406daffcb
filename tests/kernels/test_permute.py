"""MoE routing map / permute / unpermute vs an independent per-expert loop in float64."""

from __future__ import annotations

import pytest
import torch
from plait.kernels import permute, topk_to_routing_map, unpermute
from plait.kernels._dispatch import use_triton


def _routing(t, e, k, seed=0, device="cpu", empty_expert=None):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(t, e, generator=g)
    if empty_expert is not None:
        logits[:, empty_expert] = -1e9
    probs, idx = logits.softmax(-1).topk(k, -1)
    return idx.to(device), probs.to(device)


def test_topk_to_routing_map_and_expert_offset():
    idx = torch.tensor([[0, 3], [5, 1], [2, 4]])
    p = torch.tensor([[0.6, 0.4], [0.7, 0.3], [0.5, 0.5]])
    rm, probs = topk_to_routing_map(idx, p, 6)
    assert rm.dtype == torch.bool and probs.dtype == torch.float32
    assert rm.sum().item() == 6 and probs[1, 5].item() == pytest.approx(0.7)
    # local experts 2..4 of an EP rank
    rm_l, probs_l = topk_to_routing_map(idx, p, 3, expert_offset=2)
    assert rm_l.tolist() == [[False, True, False], [False, False, False], [True, False, True]]
    assert probs_l[0, 1].item() == pytest.approx(0.4)


def check_permute_roundtrip(dtype, t, h, e, k, align, empty_expert=None, device="cpu"):
    idx, topk_p = _routing(t, e, k, device=device, empty_expert=empty_expert)
    topk_p = topk_p.requires_grad_()
    torch.manual_seed(0)
    x = torch.randn(t, h, dtype=dtype, device=device, requires_grad=True)
    rm, probs = topk_to_routing_map(idx, topk_p, e)
    xp, pp, row_map, tpe = permute(x, rm, probs, align=align)

    # Independent expected layout: per expert, its tokens in token order, zero padded.
    exp_rows, exp_probs, exp_counts = [], [], []
    for j in range(e):
        toks = rm[:, j].nonzero().flatten().tolist()
        pad = (-len(toks)) % align
        exp_rows += toks + [-1] * pad
        exp_probs += [probs[tt, j].item() for tt in toks] + [0.0] * pad
        exp_counts.append(len(toks) + pad)
    assert tpe.tolist() == exp_counts and tpe.dtype == torch.int64
    assert xp.shape == (len(exp_rows), h)
    for r, tt in enumerate(exp_rows):
        want = x[tt] if tt >= 0 else torch.zeros(h, dtype=dtype, device=device)
        assert torch.equal(xp[r], want)
    torch.testing.assert_close(pp.detach().cpu(), torch.tensor(exp_probs))

    # Unpermute weighted: an "expert" that scales its rows; compare with a float64 loop.
    scale = torch.linspace(0.5, 1.5, xp.shape[0], device=device).to(dtype)[:, None]
    y = unpermute(xp * scale, row_map, t, pp)
    dy = torch.randn_like(y)
    (y.float() * dy.float()).sum().backward()
    x64 = x.detach().double().requires_grad_()
    p64 = topk_p.detach().double().requires_grad_()
    y64 = torch.zeros(t, h, dtype=torch.float64, device=device)
    row = 0
    rows_of = {}
    for j in range(e):
        for tt in rm[:, j].nonzero().flatten().tolist():
            rows_of[(tt, j)] = row
            row += 1
        row += (-int(rm[:, j].sum())) % align
    for (tt, j), r in rows_of.items():
        slot = (idx[tt] == j).nonzero().item()
        y64[tt] = y64[tt] + x64[tt] * scale[r].double() * p64[tt, slot]
    (y64 * dy.double()).sum().backward()
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 2e-2}
    torch.testing.assert_close(y.double(), y64, **tol)
    torch.testing.assert_close(x.grad.double(), x64.grad, **tol)
    torch.testing.assert_close(topk_p.grad.double(), p64.grad, atol=tol["atol"] * 10, rtol=tol["rtol"])

    # Dense [T, E] probabilities and no weights give the same combine.
    y_dense = unpermute(xp.detach() * scale, row_map, t, probs.detach())
    torch.testing.assert_close(y_dense, y.detach())
    y_plain = unpermute(xp.detach(), row_map, t)
    torch.testing.assert_close(
        y_plain.double(), x.detach().double() * rm.sum(1, keepdim=True).double(), **tol
    )
    return use_triton(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "t,h,e,k,align,empty", [(9, 12, 5, 2, 1, None), (6, 7, 4, 3, 4, 1), (1, 5, 3, 1, 8, None)]
)
def test_permute_unpermute(run, dtype, t, h, e, k, align, empty):
    assert run(check_permute_roundtrip, dtype, t, h, e, k, align, empty) == (run.path == "triton")


def test_permute_bad_input():
    x = torch.randn(4, 3)
    with pytest.raises(ValueError, match="bool"):
        permute(x, torch.ones(4, 2))
    with pytest.raises(ValueError, match="align"):
        permute(x, torch.ones(4, 2, dtype=torch.bool), align=0)
    _, _, rmap, _ = permute(x, torch.ones(4, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="num_tokens"):
        unpermute(torch.randn(8, 3), rmap, 5)
    with pytest.raises(ValueError, match="probs"):
        unpermute(torch.randn(8, 3), rmap, 4, torch.ones(3))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_permute_gpu(dtype):
    assert check_permute_roundtrip(dtype, 64, 256, 8, 2, 16, 3, "cuda")
