"""The split-backward switch: inputs-only passes compute no weight grads; inputs + weights == full."""

from __future__ import annotations

import pytest
import torch
from plait.kernels import (
    GradDirection,
    current_grad_direction,
    gmm,
    grad_direction,
    linear_cross_entropy,
    rms_norm,
)


def test_context_nesting():
    assert current_grad_direction() == GradDirection.BOTH
    with grad_direction(GradDirection.INPUTS):
        assert current_grad_direction() == GradDirection.INPUTS
        with grad_direction(GradDirection.WEIGHTS):
            assert current_grad_direction() == GradDirection.WEIGHTS
        assert current_grad_direction() == GradDirection.INPUTS
    assert current_grad_direction() == GradDirection.BOTH
    assert GradDirection.BOTH == GradDirection.INPUTS | GradDirection.WEIGHTS
    with pytest.raises(TypeError), grad_direction("inputs"):  # type: ignore[arg-type]
        pass


def _ops():
    torch.manual_seed(0)
    x = torch.randn(9, 8, requires_grad=True)
    w_gmm = torch.randn(3, 8, 6, requires_grad=True)
    w_norm = torch.randn(8, requires_grad=True)
    w_head = torch.randn(11, 8, requires_grad=True)
    tpe = torch.tensor([4, 0, 5])

    def forward():
        h = rms_norm(x, w_norm)
        a = gmm(h, w_gmm, tpe)
        b = torch.nn.functional.pad(a, (0, 2))  # 8 features again for the head
        return linear_cross_entropy(b, w_head, torch.arange(9) % 11)

    return forward, x, [w_gmm, w_norm, w_head]


def _split_pass(direction):
    forward, x, ws = _ops()
    loss = forward()
    with grad_direction(direction):
        loss.backward()
    return x.grad, [w.grad for w in ws]


def test_inputs_only_computes_no_weight_grads_and_inputs_plus_weights_equals_full():
    forward, x, ws = _ops()
    forward().backward()
    full_x, full_ws = x.grad, [w.grad for w in ws]

    x_in, ws_in = _split_pass(GradDirection.INPUTS)
    assert all(g is None for g in ws_in)
    torch.testing.assert_close(x_in, full_x)

    # One graph: inputs pass, then weights pass (graph retained), like a zero-bubble schedule on a
    # single plait op. Weight grads of the *last* op (the classifier) come out exactly; x gets no
    # extra contribution from the weights pass.
    forward, x, ws = _ops()
    loss = forward()
    with grad_direction(GradDirection.INPUTS):
        loss.backward(retain_graph=True)
    gx = x.grad.clone()
    assert all(w.grad is None for w in ws)
    with grad_direction(GradDirection.WEIGHTS):
        loss.backward()
    torch.testing.assert_close(x.grad, gx)
    torch.testing.assert_close(ws[2].grad, full_ws[2])


@pytest.mark.parametrize("op", ["gmm", "rms_norm", "linear_ce", "linear_ce_one_pass"])
def test_per_op_split_equals_full(op):
    torch.manual_seed(1)
    x = torch.randn(7, 8, requires_grad=True)
    if op == "gmm":
        w = torch.randn(3, 5, 8, requires_grad=True)
        f = lambda: gmm(x, w, torch.tensor([2, 0, 5]), trans_w=True)  # noqa: E731
    elif op == "rms_norm":
        w = torch.randn(8, requires_grad=True)
        f = lambda: rms_norm(x, w, offset=1.0)  # noqa: E731
    elif op == "linear_ce":
        w = torch.randn(13, 8, requires_grad=True)
        f = lambda: linear_cross_entropy(x, w, torch.arange(7), reduction="none", chunk_vocab=5)  # noqa: E731
    else:  # gradients computed in the forward, returned by the inputs / weights passes
        w = torch.randn(13, 8, requires_grad=True)
        f = lambda: linear_cross_entropy(x, w, torch.arange(7), grad_in_forward=True, chunk_tokens=3)  # noqa: E731
    y = f()
    dy = torch.randn_like(y)
    gx, gw = torch.autograd.grad(y, (x, w), dy)
    y = f()
    with grad_direction(GradDirection.INPUTS):
        y.backward(dy, retain_graph=True)
    assert w.grad is None and x.grad is not None
    with grad_direction(GradDirection.WEIGHTS):
        y.backward(dy)
    torch.testing.assert_close(x.grad, gx)
    torch.testing.assert_close(w.grad, gw)


def test_compiled_backward_reads_the_switch_when_it_runs():
    """A compiled graph's backward is traced once; plait's backward ops read the switch each run.

    The graph is traced while the switch says INPUTS: a switch read at trace time would freeze
    "no weight grads" into it. Inside a compiled graph only weight grads are switched off (a weights
    pass needs the activation grads inside the graph), so inputs + weights still equals the full pass.
    """
    forward, x, ws = _ops()
    forward().backward()
    full_x, full_ws = x.grad.clone(), [w.grad.clone() for w in ws]
    compiled = torch.compile(forward, fullgraph=True, backend="aot_eager")
    with grad_direction(GradDirection.INPUTS):
        loss = compiled()  # traced (forward and backward graphs) under INPUTS
    got = torch.autograd.grad(loss, [x, *ws])  # runs under BOTH
    torch.testing.assert_close(got[0], full_x)
    for g, ref in zip(got[1:], full_ws):
        torch.testing.assert_close(g, ref)
    torch._dynamo.reset()
    # The inputs pass keeps the graph for the weights pass: no donated buffers (as plait.loop sets).
    with torch._functorch.config.patch(donated_buffer=False):
        compiled = torch.compile(forward, fullgraph=True, backend="aot_eager")
        loss = compiled()
        with grad_direction(GradDirection.INPUTS):
            got_in = torch.autograd.grad(loss, [x, *ws], retain_graph=True)
        with grad_direction(GradDirection.WEIGHTS):
            got_w = torch.autograd.grad(loss, ws)
    torch.testing.assert_close(got_in[0], full_x)
    # The custom ops' weight grads are skipped (zeros): gmm's and the head's. rms_norm traces as plain
    # PyTorch inside a compiled graph (Inductor fuses it), so autograd computes its weight grad in both
    # passes and returns the full one.
    assert got_in[1].abs().sum() == 0 and got_in[3].abs().sum() == 0
    torch.testing.assert_close(got_in[2], full_ws[1])
    for g, ref in zip(got_w, full_ws):
        torch.testing.assert_close(g, ref)
