"""plait's kernels are torch custom ops: ``torch.library.opcheck`` (schema, fake implementation vs the
real one, autograd registration, AOT dispatch) on both paths, and a compiled (``fullgraph=True``)
MoE-expert + loss chain equals eager (the loss in its two-pass and one-pass modes)."""

from __future__ import annotations

import pytest
import torch
from plait.kernels import gmm, linear_cross_entropy, permute, rms_norm, swiglu_fused, unpermute
from plait.kernels._dispatch import use_triton


def _op_cases():
    torch.manual_seed(0)
    ops = torch.ops.plait
    x = torch.randn(6, 16, requires_grad=True)
    r = torch.randn(6, 16, requires_grad=True)
    w = torch.randn(16, requires_grad=True)
    gu = torch.randn(6, 32, requires_grad=True)
    pw = torch.rand(6, requires_grad=True)
    we = torch.randn(3, 8, 16, requires_grad=True)
    tpe = torch.tensor([2, 0, 3])  # 5 of 6 rows: the last row is past the groups
    src = torch.tensor([3, -1, 0, 5, 1, 2, -1])
    dst = torch.tensor([[2, -1], [4, -1], [5, -1], [0, -1], [-1, -1], [3, -1]])
    wk = torch.rand(6, 2, requires_grad=True)
    wr = torch.rand(7)
    hid = torch.randn(5, 16, requires_grad=True)
    head = torch.randn(11, 16, requires_grad=True)
    tgt = torch.tensor([1, -100, 10, 4, 0])
    return [
        (ops.rms_norm, (x, r, w, 1e-6, 0.0)),
        (ops.rms_norm, (x, None, w, 1e-6, 1.0)),
        (ops.rms_norm, (x, None, None, 1e-6, 0.0)),
        (ops.swiglu, (gu, None, pw)),
        (ops.swiglu, (x, r, None)),
        (ops.swiglu, (gu, None, pw, torch.tensor([6]))),
        (ops.gmm, (x, we, tpe, True, "loop")),
        (ops.gmm_host, (x.detach(), we.detach(), tpe, True, "loop")),
        (ops.gmm_weight_grad, (torch.randn(6, 8), x.detach(), we.detach(), tpe, True, "loop")),
        (ops.permute_rows, (x, src, dst)),
        (ops.unpermute_rows, (torch.randn(7, 16, requires_grad=True), src, dst, wk, wr)),
        (ops.permute_rows, (x, src, dst, torch.tensor([7]))),
        (ops.unpermute_rows, (torch.randn(7, 16, requires_grad=True), src, dst, wk, wr, torch.tensor([7]))),
        (ops.linear_cross_entropy, (hid, head, tgt, -100, 1e-3, None, None, 3, 4)),
        (ops.linear_cross_entropy_fused, (hid, head, tgt, -100, 1e-3, 2.0, 2, 4, True, True)),
        (ops.linear_cross_entropy_fused, (hid, head, tgt, -100, 0.0, None, 3, 16, False, True)),
        (
            ops.linear_cross_entropy_fused_backward,
            (torch.tensor(1.5), hid.detach(), head.detach(), True, True),
        ),
        (
            ops.linear_cross_entropy_fused_backward,
            (torch.tensor(0.5), hid.detach(), head.detach(), False, True),
        ),
    ]


def check_opcheck() -> bool:
    for op, args in _op_cases():
        torch.library.opcheck(op, args)
    return use_triton(torch.zeros(1))


def test_opcheck(run):
    assert run(check_opcheck) == (run.path == "triton")


def _chain(x, res, norm_w, w1, w2, head, idx, probs, targets, grad_in_forward):
    h, _ = rms_norm(x, norm_w, residual=res)
    rows, row_w, row_map, tpe = permute(h, idx, w1.shape[0], probs, align=2)
    a = swiglu_fused(gmm(rows, w1, tpe, trans_w=True), row_w, num_rows=tpe.sum())
    y = unpermute(gmm(a, w2, tpe, trans_w=True), row_map)
    return linear_cross_entropy(
        y, head, targets, chunk_tokens=4, chunk_vocab=5, grad_in_forward=grad_in_forward
    )


def check_compiled_chain(grad_in_forward: bool) -> bool:
    torch.manual_seed(1)
    t, hdim, e, k, inter, v = 9, 16, 4, 2, 8, 13
    leaves = [
        torch.randn(t, hdim),
        torch.randn(t, hdim),
        torch.rand(hdim) + 0.5,
        torch.randn(e, 2 * inter, hdim) * 0.3,
        torch.randn(e, hdim, inter) * 0.3,
        torch.randn(v, hdim) * 0.3,
    ]
    leaves = [p.requires_grad_() for p in leaves]
    probs, idx = torch.randn(t, e).softmax(-1).topk(k, -1)
    idx[0, 1] = e  # a dropped slot
    probs = probs.requires_grad_()
    targets = torch.randint(0, v, (t,))
    ref_loss = _chain(*leaves, idx, probs, targets, grad_in_forward)
    ref = torch.autograd.grad(ref_loss, [*leaves, probs])
    compiled = torch.compile(_chain, fullgraph=True, backend="aot_eager")
    loss = compiled(*leaves, idx, probs, targets, grad_in_forward)
    got = torch.autograd.grad(loss, [*leaves, probs])
    torch.testing.assert_close(loss, ref_loss)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b)
    return use_triton(leaves[0])


@pytest.mark.parametrize("grad_in_forward", [False, True])
def test_compiled_chain_matches_eager(run, grad_in_forward):
    assert run(check_compiled_chain, grad_in_forward) == (run.path == "triton")


@pytest.mark.gpu
@pytest.mark.parametrize("grad_in_forward", [False, True])
def test_compiled_chain_inductor_cuda(grad_in_forward):
    # Inductor around the Triton custom ops on a GPU.
    torch.manual_seed(2)
    dev = "cuda"
    x = torch.randn(64, 128, device=dev, requires_grad=True)
    res = torch.randn(64, 128, device=dev, requires_grad=True)
    norm_w = (torch.rand(128, device=dev) + 0.5).requires_grad_()
    w1 = (torch.randn(8, 64, 128, device=dev) * 0.1).requires_grad_()
    w2 = (torch.randn(8, 128, 32, device=dev) * 0.1).requires_grad_()
    head = (torch.randn(100, 128, device=dev) * 0.1).requires_grad_()
    probs, idx = torch.randn(64, 8, device=dev).softmax(-1).topk(2, -1)
    probs = probs.requires_grad_()
    targets = torch.randint(0, 100, (64,), device=dev)
    leaves = [x, res, norm_w, w1, w2, head]
    ref_loss = _chain(*leaves, idx, probs, targets, grad_in_forward)
    ref = torch.autograd.grad(ref_loss, [*leaves, probs])
    compiled = torch.compile(_chain, fullgraph=True)
    loss = compiled(*leaves, idx, probs, targets, grad_in_forward)
    got = torch.autograd.grad(loss, [*leaves, probs])
    torch.testing.assert_close(loss, ref_loss, atol=1e-4, rtol=1e-4)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-3)


def test_eager_calls_skip_the_dispatcher_and_match_the_ops():
    """Eager ``rms_norm`` / ``swiglu`` run the ops' implementation and autograd formula without the
    custom-op dispatcher (whose host time rivals a memory-bound kernel's GPU time), with the same
    results as ``torch.ops.plait``."""
    from plait.kernels import rms_norm, swiglu

    torch.manual_seed(0)
    x = torch.randn(4, 32, requires_grad=True)
    r = torch.randn(4, 32, requires_grad=True)
    w = torch.randn(32, requires_grad=True)
    dy = torch.randn(4, 32)

    def grads(fn):
        outs = fn()
        torch.autograd.backward(outs, [dy] * len(outs))
        got = [t.detach().clone() for t in outs] + [t.grad.clone() for t in (x, r, w)]
        for t in (x, r, w):
            t.grad = None
        return got

    def via_ops():
        y, h, _ = torch.ops.plait.rms_norm(x, r, w, 1e-6, 0.0)
        return [y, h, torch.ops.plait.swiglu(x, r, None)]

    with torch.profiler.profile() as prof:
        eager = grads(lambda: [*rms_norm(x, w, residual=r), swiglu(x, r)])
    assert not [e.name for e in prof.events() if "plait" in e.name]
    with torch.profiler.profile() as prof:
        ops = grads(via_ops)
    assert "plait::rms_norm_backward" in {e.name for e in prof.events()}  # the check can see them
    for a, b in zip(eager, ops, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_compiled_moe_ops_trace_into_the_graph():
    """Under ``torch.compile`` the permutation and the grouped GEMM (``triton_op``s) are traced into the
    graph: no custom-op call per MoE layer (each costs ~100 us of host time, which left compiled MoE
    layers host-bound). Only the grouped GEMM's weight gradient stays opaque: it reads the
    split-backward switch each time it runs."""
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified

    graphs: list[torch.fx.GraphModule] = []

    def capture(gm, example_inputs):
        def keep(g, _inputs):
            graphs.append(g)
            return make_boxed_func(g)

        return aot_module_simplified(gm, example_inputs, fw_compiler=keep, bw_compiler=keep)

    def layer(x, w1, w2, idx, probs):
        rows, row_w, row_map, tpe = permute(x, idx, w1.shape[0], probs, align=2)
        h = gmm(rows, w1, tpe, trans_w=True, backend="torch")
        return unpermute(gmm(swiglu_fused(h, row_w), w2, tpe, trans_w=True, backend="torch"), row_map)

    torch.manual_seed(0)
    x = torch.randn(6, 16, requires_grad=True)
    w1 = (torch.randn(4, 16, 16) * 0.3).requires_grad_()
    w2 = (torch.randn(4, 16, 8) * 0.3).requires_grad_()
    probs, idx = torch.randn(6, 4).softmax(-1).topk(2, -1)
    probs.requires_grad_()
    torch.compile(layer, backend=capture, fullgraph=True)(x, w1, w2, idx, probs).sum().backward()
    forward, backward = graphs
    ops = [{str(n.target) for n in g.graph.nodes if n.op == "call_function"} for g in graphs]
    assert {op for op in ops[0] if op.startswith("plait.")} == set(), forward.code
    assert {op for op in ops[1] if op.startswith("plait.")} == {"plait.gmm_weight_grad.default"}, (
        backward.code
    )
    assert "aten._grouped_mm.default" in ops[0] and "aten._grouped_mm.default" in ops[1]


def test_compile_caches_are_tagged_with_the_kernels_source(tmp_path):
    """``torch.compile``'s caches key a graph by what Dynamo traced, where a plait op is one node, not by what
    a ``triton_op`` expands to below it: importing plait.kernels tags them with a digest of its source, so a
    cache filled by another version cannot hand back that version's compiled ops (a graph calling an op that
    no longer exists failed so)."""
    import shutil

    from plait.kernels import _compile_cache

    tag = _compile_cache.source_tag()
    assert tag in torch.compiler.config.cache_key_tag.split(",")
    copy = tmp_path / "kernels"
    shutil.copytree(_compile_cache._ROOT, copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert _compile_cache.source_tag(copy) == tag
    gmm_py = copy / "gmm.py"
    gmm_py.write_text(gmm_py.read_text() + "\n# another version\n")
    assert _compile_cache.source_tag(copy) != tag
    with torch.compiler.config.patch(cache_key_tag="mine"):  # the user's own tag is kept, ours added once
        _compile_cache.tag_compile_caches(tag)
        _compile_cache.tag_compile_caches(tag)
        assert torch.compiler.config.cache_key_tag == f"mine,{tag}"
