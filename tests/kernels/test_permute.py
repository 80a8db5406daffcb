"""MoE permute / unpermute vs an independent per-expert loop in float64; no host sync."""

from __future__ import annotations

import pytest
import torch
from plait.kernels import permute, permuted_rows, unpermute
from plait.kernels._dispatch import use_triton


def _routing(t, e, k, seed=0, device="cpu", empty_expert=None):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(t, e, generator=g)
    if empty_expert is not None:
        logits[:, empty_expert] = -1e9
    probs, idx = logits.softmax(-1).topk(k, -1)
    return idx.to(device), probs.to(device)


def check_permute_roundtrip(dtype, t, h, e, k, align, empty_expert=None, device="cpu", drop=False):
    idx, topk_p = _routing(t, e, k, device=device, empty_expert=empty_expert)
    if drop:  # skipped choices: the capacity sentinel E and another rank's expert (-1)
        idx[0, 0] = e
        if t > 1:
            idx[t - 1, k - 1] = -1
    topk_p = topk_p.requires_grad_()
    torch.manual_seed(0)
    x = torch.randn(t, h, dtype=dtype, device=device, requires_grad=True)
    xp, pp, row_map, tpe = permute(x, idx, e, topk_p, align=align)

    # Independent expected layout: per expert, its tokens in token order, zero padded; then a tail
    # that is not written (on the PyTorch path zeros).
    exp_rows, exp_probs, exp_counts = [], [], []
    for j in range(e):
        toks = [tt for tt in range(t) if j in idx[tt].tolist()]
        pad = (-len(toks)) % align
        exp_rows += toks + [-1] * pad
        exp_probs += [topk_p[tt, idx[tt].tolist().index(j)].item() for tt in toks] + [0.0] * pad
        exp_counts.append(len(toks) + pad)
    m = t * k + e * (align - 1)
    assert permuted_rows(t, k, e, align) == m
    exp_rows += [-1] * (m - len(exp_rows))
    exp_probs += [0.0] * (m - len(exp_probs))
    assert tpe.tolist() == exp_counts and tpe.dtype == torch.int64
    assert xp.shape == (m, h)
    assert row_map.src.tolist() == exp_rows
    assert row_map.rows is not None and row_map.rows.tolist() == [sum(exp_counts)]
    for r, tt in enumerate(exp_rows[: sum(exp_counts)]):
        want = x[tt] if tt >= 0 else torch.zeros(h, dtype=dtype, device=device)
        assert torch.equal(xp[r], want)
    if not use_triton(x):  # the PyTorch path still zeroes the tail
        assert not xp[sum(exp_counts) :].any()
    torch.testing.assert_close(pp.detach().cpu(), torch.tensor(exp_probs))

    # Unpermute weighted: an "expert" that scales its rows; compare with a float64 loop. The tail
    # rows hold NaN, as uncomputed grouped-GEMM rows may: unpermute must never read them.
    scale = torch.linspace(0.5, 1.5, xp.shape[0], device=device).to(dtype)[:, None]
    tail = torch.zeros(m, 1, dtype=dtype, device=device)
    tail[sum(exp_counts) :] = float("nan")
    y = unpermute(xp * scale + tail, row_map, pp)
    dy = torch.randn_like(y)
    (y.float() * dy.float()).sum().backward()
    x64 = x.detach().double().requires_grad_()
    p64 = topk_p.detach().double().requires_grad_()
    y64 = torch.zeros(t, h, dtype=torch.float64, device=device)
    for r, tt in enumerate(exp_rows):
        if tt >= 0:
            j = next(jj for jj in range(e) if sum(exp_counts[: jj + 1]) > r)
            slot = idx[tt].tolist().index(j)
            y64[tt] = y64[tt] + x64[tt] * scale[r].double() * p64[tt, slot]
    (y64 * dy.double()).sum().backward()
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 2e-2}
    torch.testing.assert_close(y.double(), y64, **tol)
    torch.testing.assert_close(x.grad.double(), x64.grad, **tol)
    torch.testing.assert_close(topk_p.grad.double(), p64.grad, atol=tol["atol"] * 10, rtol=tol["rtol"])

    # [T, k] probabilities in topk order and no weights give the same combine.
    y_topk = unpermute(xp.detach() * scale, row_map, topk_p.detach())
    torch.testing.assert_close(y_topk, y.detach())
    y_plain = unpermute(xp.detach(), row_map)
    kept = ((idx >= 0) & (idx < e)).sum(1, keepdim=True).double()
    torch.testing.assert_close(y_plain.double(), x.detach().double() * kept, **tol)
    return use_triton(x)


def test_permute_is_sync_free_and_static():
    # No host sync: the output shape comes from the shapes alone, and torch.compile traces it whole.
    idx, p = _routing(7, 5, 2)
    x = torch.randn(7, 4)
    fn = torch.compile(lambda x, i, p: permute(x, i, 5, p, align=4), fullgraph=True, backend="eager")
    xp, pp, rmap, tpe = fn(x, idx, p)
    assert xp.shape == (7 * 2 + 5 * 3, 4)
    ref = permute(x, idx, 5, p, align=4)
    assert torch.equal(xp, ref[0]) and torch.equal(pp, ref[1]) and torch.equal(tpe, ref[3])
    assert torch.equal(rmap.dst, ref[2].dst) and torch.equal(rmap.src, ref[2].src)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "t,h,e,k,align,empty,drop",
    [
        (9, 12, 5, 2, 1, None, False),
        (6, 7, 4, 3, 4, 1, True),
        (1, 5, 3, 1, 8, None, False),
        (8, 6, 4, 2, 1, None, True),
    ],
)
def test_permute_unpermute(run, dtype, t, h, e, k, align, empty, drop):
    assert run(check_permute_roundtrip, dtype, t, h, e, k, align, empty, "cpu", drop) == (
        run.path == "triton"
    )


def check_permute_max_rows(dtype, t, h, e, k, align, drop=False):
    """``max_rows`` below, at and above the bound against the full permute (itself checked against the
    per-expert loop above): the same group rows up to the cap, the copies past it skipped (``dst == -1``),
    the full group sizes returned (their sum exceeds the cap exactly when it overflowed), and unpermute's
    output and gradients those of the kept copies alone (float64 loop)."""
    idx, topk_p = _routing(t, e, k, seed=1)
    if drop:
        idx[0, 0] = e
    torch.manual_seed(1)
    x = torch.randn(t, h, dtype=dtype)
    full, full_p, full_map, full_tpe = permute(x, idx, e, topk_p, align=align)
    bound = permuted_rows(t, k, e, align)
    used = int(full_tpe.sum())
    # Tokens as a strided view (as the all-gather dispatch's packed rows give them): the same rows.
    strided = torch.cat([x, torch.randn(t, 3).to(dtype)], 1)[:, :h]
    assert not strided.is_contiguous()
    assert torch.equal(permute(strided, idx, e, topk_p, align=align, max_rows=used - 1)[0], full[: used - 1])
    for cap in sorted({0, 1, used // 2, used - 1, used, bound, bound + 5}):
        xb = x.clone().requires_grad_()
        pb = topk_p.clone().requires_grad_()
        xp, pp, rmap, tpe = permute(xb, idx, e, pb, align=align, max_rows=cap)
        m = min(cap, bound)
        assert xp.shape == (m, h) and pp.shape == (m,) and rmap.src.shape == (m,)
        assert torch.equal(tpe, full_tpe)  # never truncated: the caller detects overflow by its sum
        assert (int(tpe.sum()) > m) == (cap < used)
        # the groups' rows (those past them are not written)
        written = min(m, used)
        assert torch.equal(xp.detach()[:written], full[:written]) and torch.equal(pp.detach(), full_p[:m])
        if not use_triton(x):  # the PyTorch path still zeroes the tail
            assert torch.equal(xp.detach(), full[:m])
        assert torch.equal(rmap.src, full_map.src[:m])
        assert torch.equal(rmap.dst, torch.where(full_map.dst < m, full_map.dst, -1))
        # An expert that scales its rows; the kept copies are those whose full-buffer row is below the cap.
        scale = torch.linspace(0.5, 1.5, m).to(dtype)[:, None]
        y = unpermute(xp * scale, rmap, pp)
        dy = torch.randn(t, h, generator=torch.Generator().manual_seed(cap)).to(dtype)
        (y.float() * dy.float()).sum().backward()
        x64, p64 = x.double().requires_grad_(), topk_p.double().requires_grad_()
        y64 = torch.zeros(t, h, dtype=torch.float64)
        for tt in range(t):
            for j in range(k):
                r = int(full_map.dst[tt, j])
                if 0 <= r < m:
                    y64[tt] = y64[tt] + x64[tt] * scale[r].double() * p64[tt, j]
        if y64.requires_grad:  # not when no copy is kept (cap 0)
            (y64 * dy.double()).sum().backward()
        gx64 = x64.grad if x64.grad is not None else torch.zeros_like(x64)
        gp64 = p64.grad if p64.grad is not None else torch.zeros_like(p64)
        tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 2e-2}
        torch.testing.assert_close(y.double(), y64.detach(), **tol)
        torch.testing.assert_close(xb.grad.double(), gx64, **tol)
        torch.testing.assert_close(pb.grad.double(), gp64, atol=tol["atol"] * 10, rtol=tol["rtol"])
    return use_triton(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,h,e,k,align,drop", [(9, 6, 4, 2, 1, False), (6, 5, 3, 2, 4, True)])
def test_permute_max_rows(run, dtype, t, h, e, k, align, drop):
    assert run(check_permute_max_rows, dtype, t, h, e, k, align, drop) == (run.path == "triton")


def test_permute_max_rows_compiles_static():
    idx, p = _routing(7, 5, 2)
    x = torch.randn(7, 4)
    fn = torch.compile(lambda x, i, p: permute(x, i, 5, p, max_rows=6), fullgraph=True, backend="eager")
    xp, pp, rmap, tpe = fn(x, idx, p)
    ref = permute(x, idx, 5, p, max_rows=6)
    assert xp.shape == (6, 4) and torch.equal(xp, ref[0]) and torch.equal(tpe, ref[3])
    assert torch.equal(pp, ref[1]) and torch.equal(rmap.dst, ref[2].dst)


def test_permute_bad_input():
    x = torch.randn(4, 3)
    idx = torch.zeros(4, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="integer"):
        permute(x, torch.ones(4, 2), 2)
    with pytest.raises(ValueError, match="align"):
        permute(x, idx, 2, align=0)
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="max_rows must be an int >= 0 or None"):
            permute(x, idx, 2, max_rows=bad)
    with pytest.raises(ValueError, match="topk_idx"):
        permute(x, idx[:3], 2)
    _, _, rmap, _ = permute(x, idx, 2)
    with pytest.raises(ValueError, match="permuted"):
        unpermute(torch.randn(7, 3), rmap)
    with pytest.raises(ValueError, match="probs"):
        unpermute(torch.randn(8, 3), rmap, torch.ones(3))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_permute_gpu(dtype):
    assert check_permute_roundtrip(dtype, 64, 256, 8, 2, 16, 3, "cuda", True)
