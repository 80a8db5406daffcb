"""Blockwise linear + cross-entropy vs a float64 materialised reference (incl. vocab-parallel on gloo)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from plait.kernels import (
    GradDirection,
    grad_direction,
    linear_cross_entropy,
    linear_cross_entropy_reference,
)
from plait.kernels._dispatch import use_triton

from tests.kernels.conftest import to64


def _ref(x, w, t, ignore_index=-100, reduction="mean", z_loss=0.0, softcap=None):
    logits = x @ w.T
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    lse = torch.logsumexp(logits, -1)
    ce = F.cross_entropy(logits, t, ignore_index=ignore_index, reduction="none")
    loss = torch.where(t != ignore_index, ce + z_loss * lse**2, 0.0)
    n = (t != ignore_index).sum()
    red = {"none": loss, "sum": loss.sum(), "mean": loss.sum() / n}[reduction]
    return red, lse


CASES = [
    {},
    {"reduction": "sum", "z_loss": 1e-3},
    {"reduction": "none", "softcap": 4.0},
    {"reduction": "mean", "softcap": 3.0, "z_loss": 1e-2, "return_lse": True},
]


def check_lce(dtype, n, h, v, kw, chunks=(5, 16), device="cpu"):
    torch.manual_seed(0)
    x = (torch.randn(n, h, device=device) * 0.5).to(dtype).requires_grad_()
    w = (torch.randn(v, h, device=device) * 0.5).to(dtype).requires_grad_()
    t = torch.randint(0, v, (n,), device=device)
    t[1::4] = -100
    kw = dict(kw)
    ret_lse = kw.pop("return_lse", False)
    out = linear_cross_entropy(
        x, w, t, return_lse=ret_lse, chunk_tokens=chunks[0], chunk_vocab=chunks[1], **kw
    )
    loss, lse = out if ret_lse else (out, None)
    assert loss.dtype == torch.float32
    torch.manual_seed(1)
    g = torch.randn_like(loss)
    total = (loss * g).sum() + (lse.sum() * 0.3 if ret_lse else 0)
    total.backward()
    x64, w64 = to64(x, w)
    loss64, lse64 = _ref(x64, w64, t, **kw)
    total64 = (loss64 * g.double()).sum() + (lse64.sum() * 0.3 if ret_lse else 0)
    total64.backward()
    # bf16: logits tiles are bf16 like eager PyTorch; errors scale with |logits| ~ sqrt(H)/4.
    tol = {"atol": 2e-5, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 6e-2, "rtol": 3e-2}
    torch.testing.assert_close(loss.double(), loss64, **tol)
    if ret_lse:
        torch.testing.assert_close(lse.double(), lse64.detach(), **tol)
    torch.testing.assert_close(x.grad.double(), x64.grad, **tol)
    torch.testing.assert_close(w.grad.double(), w64.grad, **tol)
    return use_triton(x)


# The interpreter is slow: the Triton path runs every option in fp32 and the default in bf16.
MATRIX = [(torch.float32, kw) for kw in CASES] + [(torch.bfloat16, kw) for kw in CASES]
TRITON_MATRIX = [(torch.float32, kw) for kw in CASES] + [(torch.bfloat16, CASES[0])]


@pytest.mark.parametrize("dtype,kw", MATRIX)
def test_linear_ce_matches_float64(dtype, kw):
    assert not check_lce(dtype, 13, 8, 37, kw)


@pytest.mark.parametrize("dtype,kw", TRITON_MATRIX)
def test_linear_ce_triton_interpreted_matches_float64(interpreter_pool, dtype, kw):
    assert interpreter_pool.apply(check_lce, (dtype, 13, 8, 37, kw))


def test_linear_ce_single_chunk_and_one_row():
    check_lce(torch.float32, 1, 8, 5, {"reduction": "sum"}, chunks=(1024, 4096))
    check_lce(torch.float32, 7, 8, 33, {"reduction": "sum"}, chunks=(3, 7))


def test_linear_ce_all_ignored_mean_is_zero():
    x = torch.randn(3, 4, requires_grad=True)
    w = torch.randn(5, 4, requires_grad=True)
    loss = linear_cross_entropy(x, w, torch.full((3,), -100))
    loss.backward()
    assert loss.item() == 0.0 and x.grad.abs().sum() == 0


def test_linear_ce_does_not_materialise_logits(monkeypatch):
    # Every matmul the op runs must be a tile no larger than chunk_tokens x chunk_vocab.
    seen = []
    orig = torch.Tensor.__matmul__

    def spy(a, b):
        out = orig(a, b)
        seen.append(out.numel())
        return out

    monkeypatch.setattr(torch.Tensor, "__matmul__", spy)
    x = torch.randn(64, 8, requires_grad=True)
    w = torch.randn(300, 8, requires_grad=True)
    t = torch.randint(0, 300, (64,))
    linear_cross_entropy(x, w, t, chunk_tokens=16, chunk_vocab=32, grad_in_forward=False).backward()
    assert seen and max(seen) <= 16 * 32
    # One-pass (the default here): [chunk, V] logits tiles, all in the forward; no tile in the backward.
    seen.clear()
    loss = linear_cross_entropy(x, w, t, chunk_tokens=16, chunk_vocab=32)
    assert seen == [16 * 300] * 4
    loss.backward()
    assert len(seen) == 4
    # Without grad mode the two-pass forward runs (and no gradient work).
    seen.clear()
    with torch.no_grad():
        loss = linear_cross_entropy(x, w, t, chunk_tokens=16, chunk_vocab=32)
    assert seen and max(seen) <= 16 * 32
    torch.testing.assert_close(loss, linear_cross_entropy_reference(x.detach(), w.detach(), t))


def test_linear_ce_bad_input():
    with pytest.raises(ValueError, match="reduction"):
        linear_cross_entropy(
            torch.randn(2, 4), torch.randn(5, 4), torch.zeros(2, dtype=torch.long), reduction="avg"
        )
    with pytest.raises(ValueError, match="targets"):
        linear_cross_entropy(torch.randn(2, 4), torch.randn(5, 4), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="weight"):
        linear_cross_entropy(torch.randn(2, 4), torch.randn(5, 3), torch.zeros(2, dtype=torch.long))


def test_linear_ce_grad_in_forward_not_eligible_raises():
    x, w, t = torch.randn(4, 8, requires_grad=True), torch.randn(5, 8), torch.zeros(4, dtype=torch.long)
    for kw, why in [
        ({"return_lse": True}, "return_lse"),
        ({"reduction": "none"}, "reduction"),
        ({"backend": "cce"}, "cce"),
    ]:
        with pytest.raises(ValueError, match=why):
            linear_cross_entropy(x, w, t, grad_in_forward=True, **kw)
    with pytest.raises(ValueError, match="grad mode"), torch.no_grad():
        linear_cross_entropy(x, w, t, grad_in_forward=True)
    with pytest.raises(ValueError, match="requires grad"):
        linear_cross_entropy(x.detach(), w, t, grad_in_forward=True)


def test_linear_ce_cce_backend_missing_names_extra():
    pytest.importorskip("torch")
    try:
        import cut_cross_entropy  # noqa: F401

        pytest.skip("cut-cross-entropy is installed")
    except ImportError:
        pass
    with pytest.raises(ImportError, match=r"plait-kernels\[cce\]"):
        linear_cross_entropy(
            torch.randn(2, 4), torch.randn(5, 4), torch.zeros(2, dtype=torch.long), backend="cce"
        )


# --- one-pass mode (gradients computed in the forward) ------------------------------------------

ONE_PASS_CASES = [
    {"reduction": "sum"},
    {"reduction": "mean", "z_loss": 1e-2},
    {"reduction": "sum", "softcap": 3.0, "z_loss": 1e-3},
    {"reduction": "mean", "softcap": 4.0},
]
# (chunk_tokens, chunk_vocab): 5 does not divide 13, rows swept 16 columns a step (3 steps of 37);
# one chunk swept in one step; the defaults.
ONE_PASS_CHUNKS = [(5, 16), (13, 64), (None, None)]


def _inputs(dtype, n=13, h=8, v=37, seed=0):
    torch.manual_seed(seed)
    x = (torch.randn(n, h) * 0.5).to(dtype).requires_grad_()
    w = (torch.randn(v, h) * 0.5).to(dtype).requires_grad_()
    t = torch.randint(0, v, (n,))
    t[1::4] = -100
    return x, w, t


def check_one_pass(dtype, kw, chunks):
    """One-pass loss and gradients under a non-trivial upstream gradient vs the float64 reference."""
    x, w, t = _inputs(dtype)
    loss = linear_cross_entropy(
        x, w, t, grad_in_forward=True, chunk_tokens=chunks[0], chunk_vocab=chunks[1], **kw
    )
    assert loss.dtype == torch.float32 and loss.dim() == 0
    (loss * 3.7 + x.float().square().sum() * 0.1).backward()
    x64, w64 = to64(x, w)
    loss64 = linear_cross_entropy_reference(x64, w64, t, **kw)
    (loss64 * 3.7 + x64.square().sum() * 0.1).backward()
    tol = {"atol": 2e-5, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 6e-2, "rtol": 3e-2}
    torch.testing.assert_close(loss.double(), loss64, **tol)
    torch.testing.assert_close(x.grad.double(), x64.grad, **tol)
    torch.testing.assert_close(w.grad.double(), w64.grad, **tol)
    return use_triton(x)


@pytest.mark.parametrize("chunks", ONE_PASS_CHUNKS)
@pytest.mark.parametrize("kw", ONE_PASS_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_ce_one_pass_matches_float64(dtype, kw, chunks):
    assert not check_one_pass(dtype, kw, chunks)


@pytest.mark.parametrize(
    "dtype,kw", [(torch.float32, kw) for kw in ONE_PASS_CASES] + [(torch.bfloat16, ONE_PASS_CASES[1])]
)
def test_linear_ce_one_pass_triton_interpreted_matches_float64(interpreter_pool, dtype, kw):
    assert interpreter_pool.apply(check_one_pass, (dtype, kw, (5, 16)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("wants", ["both", "hidden", "weight"])
def test_linear_ce_one_pass_equals_two_pass(dtype, wants):
    grads = []
    for one_pass in (True, False):
        x, w, t = _inputs(dtype)
        x.requires_grad_(wants != "weight")
        w.requires_grad_(wants != "hidden")
        kw = {"z_loss": 1e-3, "softcap": 5.0, "chunk_tokens": 4, "chunk_vocab": 16}
        loss = linear_cross_entropy(x, w, t, grad_in_forward=one_pass, **kw)
        (loss * -2.5).backward()
        grads.append((loss, x.grad, w.grad))
    tol = {"atol": 1e-6, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
    (l1, gx1, gw1), (l2, gx2, gw2) = grads
    torch.testing.assert_close(l1, l2, **tol)
    assert (gx1 is None) == (gx2 is None) == (wants == "weight")
    assert (gw1 is None) == (gw2 is None) == (wants == "hidden")
    if gx1 is not None:
        torch.testing.assert_close(gx1, gx2, **tol)
    if gw1 is not None:
        torch.testing.assert_close(gw1, gw2, **tol)


def check_out_of_range_target_matches_two_pass():
    """A target past the vocabulary adds no target logit on either path (and is never read)."""
    x, w, t = _inputs(torch.float32)
    t[0] = w.shape[0] + 3
    results = []
    for one_pass in (True, False):
        xx, ww = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        loss = linear_cross_entropy(xx, ww, t, grad_in_forward=one_pass, chunk_tokens=5, chunk_vocab=16)
        loss.backward()
        results.append((loss, xx.grad, ww.grad))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    return use_triton(x)


def test_linear_ce_one_pass_out_of_range_target_triton_interpreted(interpreter_pool):
    assert interpreter_pool.apply(check_out_of_range_target_matches_two_pass, ())


def test_linear_ce_one_pass_computes_only_the_needed_gradients():
    x, w, t = _inputs(torch.float32)
    args = (x.detach(), w.detach(), t, -100, 0.0, None, 5, 16)
    ops = torch.ops.plait
    loss, dx, dw = ops.linear_cross_entropy_fused(*args, True, False)
    assert dx.shape == x.shape and dw.numel() == 0
    loss2, dx2, dw2 = ops.linear_cross_entropy_fused(*args, False, True)
    assert dx2.numel() == 0 and dw2.shape == w.shape
    torch.testing.assert_close(loss, loss2)
    loss0, _, dw0 = ops.linear_cross_entropy_fused(x.detach()[:0], w.detach(), t[:0], *args[3:], True, True)
    assert loss0.item() == 0.0 and dw0.shape == w.shape and dw0.abs().sum() == 0


def test_linear_ce_one_pass_compiled_reads_the_switch_when_it_runs():
    # Mirrors tests/kernels/test_grad_direction.py::test_compiled_backward_reads_the_switch_when_it_runs.
    x, w, t = _inputs(torch.float32, seed=2)

    def f():
        return linear_cross_entropy(torch.tanh(x), w, t, grad_in_forward=True, chunk_tokens=4) * 1.5

    gx, gw = torch.autograd.grad(f(), (x, w))
    torch._dynamo.reset()
    with torch._functorch.config.patch(donated_buffer=False):
        compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
        with grad_direction(GradDirection.INPUTS):
            loss = compiled()  # traced under INPUTS: the switch must not be frozen into the graph
            got_in = torch.autograd.grad(loss, (x, w), retain_graph=True)
        with grad_direction(GradDirection.WEIGHTS):
            got_w = torch.autograd.grad(loss, (w,))
    torch.testing.assert_close(got_in[0], gx)
    assert got_in[1].abs().sum() == 0
    torch.testing.assert_close(got_w[0], gw)


# --- vocab-parallel -----------------------------------------------------------------------------


def _vocab_parallel_rank(x, w, t, sizes, kw):
    import torch.distributed as dist

    rank = dist.get_rank()
    start = sum(sizes[:rank])
    w_local = w[start : start + sizes[rank]].clone().requires_grad_()
    xl = x.clone().requires_grad_()
    out = linear_cross_entropy(
        xl, w_local, t, process_group=dist.group.WORLD, chunk_tokens=4, chunk_vocab=6, **kw
    )
    loss, lse = out if kw.get("return_lse") else (out, None)
    total = loss.sum() + (lse.sum() * 0.5 if lse is not None else 0)
    total.backward()
    return loss.detach(), xl.grad, w_local.grad


@pytest.mark.parametrize(
    "kw", [{}, {"reduction": "none", "z_loss": 1e-2, "softcap": 5.0, "return_lse": True}]
)
def test_linear_ce_vocab_parallel_gloo(kw):
    testing = pytest.importorskip("plait.dist_core.testing")
    torch.manual_seed(0)
    n, h, sizes = 9, 8, [10, 7]  # uneven shards
    x = torch.randn(n, h)
    w = torch.randn(sum(sizes), h)
    t = torch.randint(0, sum(sizes), (n,))
    t[2] = -100
    results = testing.run_distributed(_vocab_parallel_rank, 2, x, w, t, sizes, kw)
    x64, w64 = to64(x.requires_grad_(), w.requires_grad_())
    rkw = {k: v for k, v in kw.items() if k != "return_lse"}
    loss64, lse64 = _ref(x64, w64, t, **rkw)
    total64 = loss64.sum() + (lse64.sum() * 0.5 if kw.get("return_lse") else 0)
    total64.backward()
    for loss, gx, _ in results:
        torch.testing.assert_close(loss.double(), loss64.detach(), atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(gx.double(), x64.grad, atol=1e-5, rtol=1e-4)
    gw = torch.cat([r[2] for r in results])
    torch.testing.assert_close(gw.double(), w64.grad, atol=1e-5, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_ce_gpu_real_shapes(dtype):
    assert check_lce(dtype, 1000, 512, 5003, CASES[3], chunks=(256, 1024), device="cuda")
    assert check_lce(dtype, 2048, 1024, 32000, {}, chunks=(None, None), device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_ce_one_pass_gpu_real_shapes(dtype):
    """The Triton row and scale kernels on CUDA, a Qwen-size vocabulary, several chunks (one partial)."""
    torch.manual_seed(0)
    n, h, v = 1100, 512, 151936
    x = (torch.randn(n, h, device="cuda") * 0.5).to(dtype).requires_grad_()
    w = (torch.randn(v, h, device="cuda") * 0.05).to(dtype).requires_grad_()
    t = torch.randint(0, v, (n,), device="cuda")
    t[1::7] = -100
    kw = {"reduction": "mean", "z_loss": 1e-3, "softcap": 30.0}
    loss = linear_cross_entropy(x, w, t, grad_in_forward=True, chunk_tokens=384, **kw)
    (loss * 3.7).backward()
    x64, w64 = to64(x, w)
    loss64 = linear_cross_entropy_reference(x64, w64, t, **kw)
    (loss64 * 3.7).backward()
    rel = 1e-5 if dtype == torch.float32 else 1e-2  # relative L2 error of the whole tensor
    for got, ref in ((loss, loss64), (x.grad, x64.grad), (w.grad, w64.grad)):
        assert ((got.double() - ref).norm() / ref.norm()).item() < rel


def test_linear_ce_one_pass_gradients_are_handed_over_once():
    """The eager one-pass backward scales its stored gradients in place: a second backward asking for
    one again raises (naming the way out) instead of returning a gradient scaled twice."""
    x, w, t = _inputs(torch.float32, seed=3)
    loss = linear_cross_entropy(x, w, t, grad_in_forward=True, chunk_tokens=4) * 2.0
    loss.backward(retain_graph=True)
    x64, w64 = to64(x, w)
    (linear_cross_entropy_reference(x64, w64, t) * 2.0).backward()
    torch.testing.assert_close(x.grad.double(), x64.grad, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(w.grad.double(), w64.grad, atol=1e-6, rtol=1e-5)
    with pytest.raises(RuntimeError, match=r"already returned.*grad_in_forward=False"):
        loss.backward()


@pytest.mark.gpu
def test_linear_ce_one_pass_peak_memory_gpu():
    """Forward + backward at Qwen-vocabulary shapes hold at most dW, dhidden and one logits tile beyond
    the inputs (the scaled gradients are the stored ones, not copies)."""
    torch.manual_seed(0)
    n, h, v = 8192, 4096, 151936
    x = (torch.randn(n, h, device="cuda") * 0.5).bfloat16().requires_grad_()
    w = (torch.randn(v, h, device="cuda") * 0.02).bfloat16().requires_grad_()
    t = torch.randint(0, v, (n,), device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    linear_cross_entropy(x, w, t).backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    tile = (256 * 1024 * 1024) // v // 128 * 128 * v * 2  # the default chunk's bf16 logits
    bound = w.numel() * 2 + x.numel() * 2 + tile + (64 << 20)
    assert extra <= bound, (extra / 2**30, bound / 2**30)
