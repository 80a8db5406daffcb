"""Split backward (I then W) equals a full backward, and sets the kernels' grad-direction switch."""

from __future__ import annotations

import torch
from plait.kernels.grad_direction import GradDirection, current_grad_direction
from plait.pipelining import backward_input, backward_weight
from torch import nn

CALLS: list[GradDirection] = []


class _Matmul(torch.autograd.Function):
    """x @ w.T that, like plait's kernels, computes only the gradients the current direction asks for."""

    @staticmethod
    def forward(ctx, x, w):  # type: ignore[no-untyped-def]
        ctx.save_for_backward(x, w)
        return x @ w.T

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def]
        x, w = ctx.saved_tensors
        d = current_grad_direction()
        CALLS.append(d)
        gx = g @ w if GradDirection.INPUTS in d else None
        gw = g.flatten(0, -2).T @ x.flatten(0, -2) if GradDirection.WEIGHTS in d else None
        return gx, gw


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 6)
        self.w = nn.Parameter(torch.randn(5, 6))
        self.norm = nn.LayerNorm(5)
        self.aux = nn.Parameter(torch.randn(3))

    def forward(self, x):  # type: ignore[no-untyped-def]
        h = _Matmul.apply(torch.tanh(self.a(x)), self.w)
        return self.norm(h) * 2.0, self.aux.square().sum()  # second output does not depend on x


def test_split_backward_equals_full_backward_and_sets_direction() -> None:
    torch.manual_seed(0)
    net = _Net().double()
    x = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    g = torch.randn(2, 3, 5, dtype=torch.float64)
    out, aux = net(x)
    torch.autograd.backward([out, aux], [g, torch.tensor(0.5, dtype=torch.float64)])
    ref_x = x.grad.clone()
    ref = {n: p.grad.clone() for n, p in net.named_parameters()}
    net.zero_grad()
    x.grad = None
    CALLS.clear()

    out, aux = net(x)
    (gx,), work = backward_input(
        [out, aux], [g, torch.tensor(0.5, dtype=torch.float64)], [x], list(net.parameters())
    )
    assert CALLS == [GradDirection.INPUTS]
    assert all(p.grad is None for p in net.parameters())  # no weight gradient yet
    torch.testing.assert_close(gx, ref_x, rtol=0, atol=1e-12)
    backward_weight(work)
    assert CALLS == [GradDirection.INPUTS, GradDirection.WEIGHTS]
    for n, p in net.named_parameters():
        torch.testing.assert_close(p.grad, ref[n], rtol=0, atol=1e-12, msg=n)


def test_split_backward_without_input_grads_is_all_weights() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Embedding(7, 4), nn.Linear(4, 3)).double()
    ids = torch.tensor([[1, 2, 3]])
    g = torch.randn(1, 3, 3, dtype=torch.float64)
    ref = torch.autograd.grad(net(ids), list(net.parameters()), g)
    (gi,), work = backward_input([net(ids)], [g], [ids], list(net.parameters()))
    assert gi is None
    backward_weight(work)
    for p, r in zip(net.parameters(), ref):
        torch.testing.assert_close(p.grad, r, rtol=0, atol=1e-12)


class _Embed(nn.Module):
    """A first stage: integer inputs, then a plait-style Function on the activations, then a linear."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(7, 6)
        self.w = nn.Parameter(torch.randn(5, 6))
        self.out = nn.Linear(5, 3)

    def forward(self, ids):  # type: ignore[no-untyped-def]
        return self.out(torch.tanh(_Matmul.apply(self.emb(ids), self.w)))


def test_first_stage_weight_pass_reaches_weights_behind_custom_functions() -> None:
    # With no input needing a gradient, W backpropagates the whole stage: the custom Function must still
    # produce its activation gradient there, or the embedding gets no gradient.
    torch.manual_seed(0)
    net = _Embed().double()
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    g = torch.randn(2, 3, 3, dtype=torch.float64)
    ref = torch.autograd.grad(net(ids), list(net.parameters()), g)
    CALLS.clear()
    (gi,), work = backward_input([net(ids)], [g], [ids], list(net.parameters()))
    backward_weight(work)
    assert gi is None and CALLS == [GradDirection.BOTH]
    for (n, p), r in zip(net.named_parameters(), ref):
        torch.testing.assert_close(p.grad, r, rtol=0, atol=1e-12, msg=n)


def _flops(fn) -> int:  # type: ignore[no-untyped-def]
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def test_weight_pass_runs_only_the_weight_branches() -> None:
    """W computes each weight gradient once and no activation gradient: with bias-free Linear layers,
    I and W each cost exactly half the FLOPs of the full backward (one matmul of two per layer)."""
    torch.manual_seed(0)
    net = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(32, 32, bias=False), nn.Tanh())])
    x = torch.randn(16, 32, requires_grad=True)
    g = torch.randn(16, 32)
    params = list(net.parameters())
    out = net(x)
    full = _flops(lambda: torch.autograd.backward(out, g))
    ref = [p.grad.clone() for p in params]
    net.zero_grad(set_to_none=True)
    out = net(x)
    box: list = []
    i_flops = _flops(lambda: box.extend(backward_input([out], [g], [x], params)))
    work = box[1]
    assert work.branches is not None and len(work.intermediates) == 4
    w_flops = _flops(lambda: backward_weight(work))
    assert (i_flops, w_flops) == (full // 2, full // 2)
    for p, r in zip(params, ref):
        torch.testing.assert_close(p.grad, r)


def test_weight_used_twice_takes_the_single_pass_and_matches_full_backward() -> None:
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(8, 8))
    x = torch.randn(4, 8, requires_grad=True)
    g = torch.randn(4, 8)

    def f():  # type: ignore[no-untyped-def]
        return torch.tanh(x @ w) @ w

    torch.autograd.backward(f(), g)
    ref_w, ref_x = w.grad.clone(), x.grad.clone()
    w.grad = None
    x.grad = None
    got, work = backward_input([f()], [g], [x], [w])
    assert work.branches is None  # w joins the input path at two places
    backward_weight(work)
    torch.testing.assert_close(got[0], ref_x)
    torch.testing.assert_close(w.grad, ref_w)


def test_weight_pass_after_the_outputs_are_dropped() -> None:
    # The executor drops a stage's outputs between I and W. On torch 2.11 the Python object of an autograd
    # Function's node holds that node only weakly, so the W pass found _Matmul's node freed
    # (RuntimeError: Attribute '_input_metadata' is invalid) unless the work keeps the outputs.
    torch.manual_seed(0)
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    g = torch.randn(3, 5, dtype=torch.float64)
    out = _Matmul.apply(torch.tanh(x), w)
    (gx,), work = backward_input([out], [g], [x], [w])
    del out
    backward_weight(work)
    torch.testing.assert_close(w.grad, g.T @ torch.tanh(x), rtol=0, atol=1e-12)
    torch.testing.assert_close(gx, (g @ w.detach()) * (1 - torch.tanh(x.detach()) ** 2), rtol=0, atol=1e-12)


def test_a_compiled_region_runs_its_backward_once_over_both_passes() -> None:
    """A torch.compile region is one backward node computing input and weight gradients together: the I
    pass runs it once as the whole backward, W only accumulates; both equal the eager float64 backward."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 5)).double()
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    g = torch.randn(4, 5, dtype=torch.float64)
    (ref_x,) = torch.autograd.grad(net(x), [x], g, retain_graph=False)
    ref = [gp.clone() for gp in torch.autograd.grad(net(x), list(net.parameters()), g)]

    out = torch.compile(net, backend="aot_eager", fullgraph=True)(x)
    runs: list[int] = []
    out.grad_fn.register_prehook(lambda _g: runs.append(1))
    (gx,), work = backward_input([out], [g], [x], list(net.parameters()))
    assert len(runs) == 1 and all(p.grad is None for p in net.parameters())
    del out
    backward_weight(work)
    assert len(runs) == 1
    torch.testing.assert_close(gx, ref_x, rtol=0, atol=1e-12)
    for p, r in zip(net.parameters(), ref):
        torch.testing.assert_close(p.grad, r, rtol=0, atol=1e-12)
