"""Grouped GEMM (all backends) vs a float64 per-expert loop: ragged and empty experts, both layouts."""

from __future__ import annotations

import pytest
import torch
from plait.kernels import GradDirection, gmm, grad_direction
from plait.kernels.gmm import gmm_reference


def _ref64(x, w, counts, trans_w):
    outs, s = [], 0
    for e, c in enumerate(counts):
        we = w[e].T if trans_w else w[e]
        outs.append(x[s : s + c] @ we)
        s += c
    return torch.cat(outs)


def check_gmm(dtype, counts, k, n, trans_w, backend, device="cpu"):
    torch.manual_seed(0)
    e = len(counts)
    x = torch.randn(sum(counts), k, device=device).to(dtype).requires_grad_()
    w = (torch.randn(e, n, k, device=device) if trans_w else torch.randn(e, k, n, device=device)).to(dtype)
    w.requires_grad_()
    tpe = torch.tensor(counts, device=device)
    y = gmm(x, w, tpe, trans_w=trans_w, backend=backend)
    dy = torch.randn_like(y)
    y.backward(dy)
    x64 = x.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    y64 = _ref64(x64, w64, counts, trans_w)
    y64.backward(dy.double())
    scale = k**0.5
    tol = (
        {"atol": 1e-4 * scale, "rtol": 1e-4}
        if dtype == torch.float32
        else {"atol": 2e-2 * scale, "rtol": 2e-2}
    )
    torch.testing.assert_close(y.double(), y64, **tol)
    torch.testing.assert_close(x.grad.double(), x64.grad, **tol)
    wtol = dict(tol, atol=tol["atol"] * max(max(counts), 1) ** 0.5)
    torch.testing.assert_close(w.grad.double(), w64.grad, **wtol)
    for j, c in enumerate(counts):
        if c == 0:
            assert w.grad[j].abs().sum() == 0


BACKENDS = ["loop"] + (["torch"] if hasattr(torch, "_grouped_mm") else [])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("trans_w", [False, True])
@pytest.mark.parametrize("counts", [[3, 0, 5, 1], [7], [0, 0, 4], [0, 6, 0]])
def test_gmm_matches_float64(backend, trans_w, counts):
    check_gmm(torch.float32, counts, 16, 8, trans_w, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gmm_bf16(backend):
    check_gmm(torch.bfloat16, [5, 0, 11, 2], 32, 24, True, backend)


def test_gmm_auto_backend_on_cpu_is_loop_and_works():
    check_gmm(torch.float32, [2, 3], 8, 8, False, "auto")


def test_gmm_inputs_only_has_no_weight_grad():
    x = torch.randn(5, 8, requires_grad=True)
    w = torch.randn(2, 8, 4, requires_grad=True)
    y = gmm(x, w, torch.tensor([2, 3]))
    with grad_direction(GradDirection.INPUTS):
        y.sum().backward()
    assert w.grad is None and x.grad is not None


def test_gmm_errors():
    x = torch.randn(5, 8)
    w = torch.randn(2, 8, 4)
    with pytest.raises(ValueError, match="tokens_per_expert"):
        gmm(x, w, torch.tensor([5]))
    with pytest.raises(ValueError, match="sums to"):
        gmm(x, w, torch.tensor([2, 4]))
    with pytest.raises(ValueError, match="K="):
        gmm(x, w, torch.tensor([2, 3]), trans_w=True)
    with pytest.raises(ValueError, match="backend"):
        gmm(x, w, torch.tensor([2, 3]), backend="cutlass")  # type: ignore[arg-type]
    try:
        import grouped_gemm  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match=r"plait-kernels\[gmm\]"):
            gmm(x, w, torch.tensor([2, 3]), backend="nv")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["auto", "torch", "loop"])
def test_gmm_gpu_real_shapes(backend):
    counts = [512, 0, 1024, 8, 256, 0, 2048, 136]
    check_gmm(torch.bfloat16, counts, 2048, 768, True, backend, "cuda")
    check_gmm(torch.bfloat16, counts, 768, 2048, False, backend, "cuda")


@pytest.mark.gpu
def test_gmm_under_cuda_graph_capture_keeps_the_sizes_on_the_device_or_says_why_not():
    """A CUDA graph cannot read device values on the host: bf16 operands (``_grouped_mm``) are captured and
    replay the eager result for new sizes; float32 operands (the loop) raise an error naming why."""
    tpe = torch.tensor([3, 0, 5, 8], device="cuda")
    x = torch.randn(16, 64, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4, 32, 64, device="cuda", dtype=torch.bfloat16)
    gmm(x, w, tpe, trans_w=True)  # warm-up outside the capture (cuBLAS/CUTLASS workspaces)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gmm(x, w, tpe, trans_w=True)
    tpe.copy_(torch.tensor([8, 4, 0, 4]))
    graph.replay()
    torch.testing.assert_close(out, gmm_reference(x, w, tpe.cpu(), trans_w=True), atol=0.1, rtol=2e-2)
    host = r"'loop' backend reads tokens_per_expert on the host.*bfloat16"
    with pytest.raises(RuntimeError, match=host), torch.cuda.graph(torch.cuda.CUDAGraph()):
        gmm(x.float(), w.float(), tpe, trans_w=True)
