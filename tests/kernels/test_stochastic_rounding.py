"""Stochastic rounding (unbiased) and StochasticAdamW (AdamW math, bf16 tracking, state, replicas)."""

from __future__ import annotations

import copy

import pytest
import torch
from plait.kernels import StochasticAdamW, stochastic_round
from plait.kernels._dispatch import use_triton


def check_unbiased(device="cpu"):
    g = torch.Generator().manual_seed(0)
    base = torch.randn(64, generator=g) * torch.logspace(-3, 3, 64)
    reps = 4000
    x = base.repeat(reps, 1).to(device)
    r = stochastic_round(x, generator=g).float()
    assert r.dtype == torch.float32
    # The two bf16 neighbours of x (truncation toward zero and one step away from zero).
    bits = base.view(torch.int32) & -65536
    lo, hi = bits.view(torch.float32), (bits + 65536).view(torch.float32)
    ulp = (hi - lo).abs()
    mean = r.mean(0).cpu()
    # Unbiased: mean within 5 standard errors (sd <= ulp / 2) of the fp32 value; round-to-nearest
    # would be off by up to ulp / 2.
    assert torch.all((mean - base).abs() <= 5 * (ulp / 2) / reps**0.5), ((mean - base) / ulp).abs().max()
    assert torch.all((r.cpu() == lo) | (r.cpu() == hi))
    # exactly representable values never move
    exact = torch.tensor([0.0, 1.0, -2.5, 2.0**18, float("inf")], device=device)
    assert torch.equal(stochastic_round(exact).float(), exact)
    return use_triton(x)


def test_stochastic_round_unbiased(run):
    assert run(check_unbiased) == (run.path == "triton")


def test_fp32_params_match_torch_adamw():
    torch.manual_seed(0)
    p1 = torch.nn.Parameter(torch.randn(50))
    p2 = torch.nn.Parameter(p1.detach().clone())
    o1 = StochasticAdamW([p1], lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1, seed=0)
    o2 = torch.optim.AdamW([p2], lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
    for _ in range(5):
        g = torch.randn(50)
        p1.grad, p2.grad = g.clone(), g.clone()
        o1.step()
        o2.step()
    torch.testing.assert_close(p1, p2, atol=1e-6, rtol=1e-5)


def check_grad_scale_clips_inside_the_step(device="cpu"):
    """``step(grad_scale=c)`` against torch's AdamW given the clipped gradients (fp32, exact update)."""
    torch.manual_seed(0)
    p1 = torch.nn.Parameter(torch.randn(3000, device=device))  # > one kernel block
    p2 = torch.nn.Parameter(p1.detach().clone())
    o1 = StochasticAdamW([p1], lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1, seed=0)
    o2 = torch.optim.AdamW([p2], lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
    for scale in (0.25, 1.0, 0.03):
        g = torch.randn(3000, device=device)
        p1.grad, p2.grad = g.clone(), g * scale
        o1.step(grad_scale=torch.tensor(scale, device=device))
        o2.step()
        assert torch.equal(p1.grad, g)  # the gradient itself is left unscaled
    torch.testing.assert_close(p1, p2, atol=1e-6, rtol=1e-5)
    return use_triton(p1)


def test_grad_scale_clips_inside_the_step(run):
    assert run(check_grad_scale_clips_inside_the_step) == (run.path == "triton")


def check_one_launch_equals_a_launch_per_tensor(moment_dtype):
    """All of a group's tensors in one Triton launch update each exactly as a launch of its own (same
    seeds): the block table maps every block to its tensor and its place inside it. fp32 tensors of
    the same launch also match torch's AdamW. A launch of tensors at 16-byte addresses with numels of
    16 elements takes 16-byte accesses (2048 and 4112 alone), the others narrow ones (every launch
    with a tensor of 5 elements, or the one at an odd address): both update alike."""
    from plait.kernels._triton.stochastic_rounding import adamw_triton
    from plait.kernels.stochastic_rounding import wide_access

    def odd_address(t):  # t's values, one element past a 16-byte boundary
        return torch.cat([t[:1], t])[1:]

    assert wide_access(torch.zeros(32), torch.zeros(32)) and not wide_access(torch.zeros(33))
    assert not wide_access(torch.zeros(32), odd_address(torch.zeros(32)))
    torch.manual_seed(0)
    sizes = [3000, 5, 2048, 4097, 1, 4112, 32]  # blocks of 2048: a tensor's last block is partial or full
    kw = {"lr": 1e-2, "b1": 0.8, "b2": 0.95, "eps": 1e-6, "wd": 0.1, "bc1": 0.2, "bc2": 0.05}
    scale = torch.tensor(0.5)
    for dtype in (torch.bfloat16, torch.float32):
        init = [(torch.randn(n).to(dtype), torch.randn(n).to(dtype), torch.randn(n).abs()) for n in sizes]

        def state(init=init):
            out = [
                (p.clone(), g.clone(), m.to(moment_dtype, copy=True), v.to(moment_dtype), seed)
                for seed, (p, g, m) in enumerate(init, 11)
                for v in [m * m]
            ]
            p, *rest = out[-1]
            out[-1] = (odd_address(p), *rest)
            return out

        together, apart = state(), state()
        adamw_triton(together, grad_scale=scale, **kw)
        for t in apart:
            adamw_triton([t], grad_scale=scale, **kw)
        for a, b in zip(together, apart):
            for x, y in zip(a[:4], b[:4]):
                assert torch.equal(x, y)
        if dtype == torch.float32 and moment_dtype == torch.float32:
            for (p, _g, m, v, _), (p0, g0, m0) in zip(together, init):
                gs = g0 * 0.5
                m_ref = 0.8 * m0 + 0.2 * gs
                v_ref = 0.95 * m0 * m0 + 0.05 * gs * gs
                p_ref = p0 * (1 - 1e-2 * 0.1) - 1e-2 * (m_ref / 0.2) / ((v_ref / 0.05).sqrt() + 1e-6)
                torch.testing.assert_close(p, p_ref, atol=1e-6, rtol=1e-5)
                torch.testing.assert_close(m, m_ref)
                torch.testing.assert_close(v, v_ref)
    return True


@pytest.mark.parametrize("moment_dtype", [torch.float32, torch.bfloat16])
def test_one_launch_equals_a_launch_per_tensor(interpreter_pool, moment_dtype):
    assert interpreter_pool.apply(check_one_launch_equals_a_launch_per_tensor, (moment_dtype,))


def _mlp(dtype):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    return m.to(dtype)


def _flat(m):
    return torch.cat([p.detach().float().flatten() for p in m.parameters()])


def check_tracks_fp32_master(moment_dtype, steps, device="cpu"):
    torch.manual_seed(1)
    data = [(torch.randn(64, 16, device=device), torch.randn(64, 1, device=device)) for _ in range(8)]
    ref = _mlp(torch.float32).to(device)  # fp32 weights = fp32 master
    plain = _mlp(torch.bfloat16).to(device)
    sr = _mlp(torch.bfloat16).to(device)
    kw = {"lr": 3e-4, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.0}
    opts = [
        torch.optim.AdamW(ref.parameters(), **kw),
        torch.optim.AdamW(plain.parameters(), **kw),
        StochasticAdamW(sr.parameters(), **kw, moment_dtype=moment_dtype, seed=0),
    ]
    w0 = _flat(ref)
    for i in range(steps):
        x, y = data[i % len(data)]
        for m, o in zip((ref, plain, sr), opts):
            o.zero_grad()
            dt = next(m.parameters()).dtype
            torch.nn.functional.mse_loss(m(x.to(dt)).float(), y).backward()
            o.step()
    moved = (_flat(ref) - w0).norm()
    err_plain = (_flat(plain) - _flat(ref)).norm() / moved
    err_sr = (_flat(sr) - _flat(ref)).norm() / moved
    return float(err_plain), float(err_sr), use_triton(next(sr.parameters()))


@pytest.mark.parametrize("moment_dtype", [torch.float32, torch.bfloat16])
def test_stochastic_adamw_tracks_fp32_master_where_bf16_adamw_drifts(moment_dtype):
    err_plain, err_sr, _ = check_tracks_fp32_master(moment_dtype, 100)
    # lr * update is below bf16 resolution for most weights: round-to-nearest loses most of the
    # trajectory, stochastic rounding keeps it in expectation.
    assert err_plain > 0.5, err_plain
    assert err_sr < 0.35 * err_plain, (err_sr, err_plain)


def test_stochastic_adamw_triton_interpreted(interpreter_pool):
    err_plain, err_sr, used = interpreter_pool.apply(check_tracks_fp32_master, (torch.bfloat16, 30))
    assert used
    assert err_sr < 0.5 * err_plain, (err_sr, err_plain)


def _run_steps(opt, params, grads):
    for g in grads:
        for p, gi in zip(params, g):
            p.grad = gi.clone()
        opt.step()


def test_state_dict_round_trip_continues_identically():
    torch.manual_seed(0)
    params = [
        torch.nn.Parameter(torch.randn(33, dtype=torch.bfloat16)),
        torch.nn.Parameter(torch.randn(4, 5)),
    ]
    grads = [[torch.randn_like(p) for p in params] for _ in range(6)]
    opt = StochasticAdamW(
        [{"params": params[:1], "lr": 1e-2}, {"params": params[1:], "weight_decay": 0.0}],
        lr=1e-3,
        moment_dtype=torch.bfloat16,
        seed=7,
    )
    _run_steps(opt, params, grads[:3])
    sd = copy.deepcopy(opt.state_dict())
    snapshot = [p.detach().clone() for p in params]
    _run_steps(opt, params, grads[3:])
    expect = [p.detach().clone() for p in params]

    params2 = [torch.nn.Parameter(s.clone()) for s in snapshot]
    opt2 = StochasticAdamW([{"params": params2[:1]}, {"params": params2[1:]}], lr=5.0, seed=123)
    opt2.load_state_dict(sd)
    assert opt2.param_groups[0]["lr"] == 1e-2 and opt2.param_groups[1]["weight_decay"] == 0.0
    _run_steps(opt2, params2, grads[3:])
    for a, b in zip(params2, expect):
        assert torch.equal(a, b)


def test_load_keeps_fp32_moments_of_bf16_params():
    # torch.optim casts loaded state to the param dtype; fp32 moments must survive unrounded.
    p = torch.nn.Parameter(torch.randn(8, dtype=torch.bfloat16))
    opt = StochasticAdamW([p], lr=1e-3, seed=0)
    p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    sd = copy.deepcopy(opt.state_dict())
    opt2 = StochasticAdamW([torch.nn.Parameter(p.detach().clone())], lr=1e-3, seed=1)
    opt2.load_state_dict(sd)
    st = next(iter(opt2.state.values()))
    assert st["exp_avg"].dtype == torch.float32
    assert torch.equal(st["exp_avg_sq"], sd["state"][0]["exp_avg_sq"])


def test_replicas_identical_with_same_seed_and_differ_otherwise():
    torch.manual_seed(0)
    init = torch.randn(1000, dtype=torch.bfloat16)
    grads = [torch.randn(1000) for _ in range(3)]
    outs = []
    for seed in (5, 5, 6):
        p = torch.nn.Parameter(init.clone())
        _run_steps(StochasticAdamW([p], lr=1e-3, seed=seed), [p], [[g.bfloat16()] for g in grads])
        outs.append(p.detach())
    assert torch.equal(outs[0], outs[1])
    assert not torch.equal(outs[0], outs[2])


def test_a_step_draws_one_seed_per_parameter_with_a_gradient_in_order():
    # The random stream is part of a checkpoint (rng_state): a step takes one draw per parameter that
    # has a gradient, in order, so resumed runs continue it identically. References: a generator that
    # makes those single draws, and the same updates with each parameter stepped alone, in order, by
    # optimizers sharing one generator (each seed reaches its own parameter).
    torch.manual_seed(0)
    init = [torch.randn(n, dtype=torch.bfloat16) for n in (7, 16, 0, 33)]
    grads = [[torch.randn_like(x) for x in init] for _ in range(3)]
    params = [torch.nn.Parameter(x.clone()) for x in init]
    opt = StochasticAdamW(params, lr=1e-2, seed=11)
    ref = [torch.nn.Parameter(x.clone()) for x in init]
    ref_opts = [StochasticAdamW([p], lr=1e-2) for p in ref]
    shared = torch.Generator().manual_seed(11)
    for o in ref_opts:
        o.generator = shared
    draws = torch.Generator().manual_seed(11)
    for step, g in enumerate(grads):
        for i, (p, r, gi) in enumerate(zip(params, ref, g)):
            skip = step == 1 and i == 1  # no gradient: no draw
            p.grad = None if skip else gi.clone()
            r.grad = None if skip else gi.clone()
        opt.step()
        for r, o in zip(ref, ref_opts):
            if r.grad is not None:
                o.step()
                torch.randint(0, 2**31 - 1, (1,), generator=draws)
    for a, b in zip(params, ref):
        assert torch.equal(a, b)
    assert torch.equal(opt.generator.get_state(), draws.get_state())


def test_bad_arguments():
    p = [torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(ValueError, match="moment_dtype"):
        StochasticAdamW(p, moment_dtype=torch.float16)
    with pytest.raises(ValueError, match="betas"):
        StochasticAdamW(p, betas=(1.0, 0.9))


@pytest.mark.gpu
def test_stochastic_rounding_gpu():
    assert check_unbiased("cuda")
    assert check_grad_scale_clips_inside_the_step("cuda")
    err_plain, err_sr, used = check_tracks_fp32_master(torch.float32, 150, "cuda")
    assert used and err_sr < 0.35 * err_plain
