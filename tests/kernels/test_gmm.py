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


# Triton grouped GEMM, interpreted on CPU: groups spanning several row tiles (fp32 tiles are 64 rows),
# empty groups first/middle/last, K and N that are no multiples of the tiles, both weight layouts.
@pytest.mark.parametrize("trans_w", [False, True])
@pytest.mark.parametrize("counts", [[3, 0, 5, 1], [0, 70, 0, 129], [131, 0, 0]])
def test_gmm_triton_matches_float64(interpreter_pool, trans_w, counts):
    interpreter_pool.apply(check_gmm, (torch.float32, counts, 40, 136, trans_w, "triton"))


def check_gmm_triton_leaves_rows_past_the_groups(trans_w):
    x, w = torch.randn(12, 16), torch.randn(3, 16, 8)
    w = w.transpose(1, 2).contiguous() if trans_w else w
    y = gmm(x, w, torch.tensor([2, 0, 5]), trans_w=trans_w, backend="triton")
    assert y.shape == (12, 8)
    torch.testing.assert_close(y[:7], gmm_reference(x, w, torch.tensor([2, 0, 5]), trans_w=trans_w)[:7])


def test_gmm_triton_computes_only_the_grouped_rows(interpreter_pool):
    interpreter_pool.apply(check_gmm_triton_leaves_rows_past_the_groups, (True,))


def test_gmm_auto_backend_on_cpu_is_loop_and_works():
    check_gmm(torch.float32, [2, 3], 8, 8, False, "auto")


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no _grouped_mm")
@pytest.mark.parametrize(
    ("capability", "dtype", "dims", "torch_path"),
    [
        ((9, 0), torch.bfloat16, (64, 128), True),
        ((10, 0), torch.bfloat16, (64, 128), True),
        ((12, 0), torch.bfloat16, (64, 128), False),  # consumer Blackwell: no CUTLASS kernel in torch
        ((8, 0), torch.bfloat16, (64, 128), False),
        ((9, 0), torch.float32, (64, 128), False),
        ((9, 0), torch.bfloat16, (64, 100), False),
    ],
)
def test_gmm_auto_takes_grouped_mm_only_where_its_cutlass_kernel_runs(
    monkeypatch, capability, dtype, dims, torch_path
):
    """Elsewhere torch's ``_grouped_mm`` loops on the host (a sync, and a crash under graph capture)."""
    import importlib
    from types import SimpleNamespace

    gmm_module = importlib.import_module("plait.kernels.gmm")  # the module (the package exports the function)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    k, n = dims
    x = SimpleNamespace(is_cuda=True, device="cuda:0", dtype=dtype, shape=(32, k))
    w = SimpleNamespace(dtype=dtype, shape=(4, k, n))
    assert gmm_module._torch_path(x, w) is torch_path


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
    with pytest.raises(RuntimeError, match=r"backend='triton'.*CUDA tensors"):
        gmm(x, w, torch.tensor([2, 3]), backend="triton")  # CPU tensors, not interpreted
    try:
        import grouped_gemm  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match=r"plait-kernels\[gmm\]"):
            gmm(x, w, torch.tensor([2, 3]), backend="nv")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["auto", "torch", "triton", "loop"])
def test_gmm_gpu_real_shapes(backend):
    counts = [512, 0, 1024, 8, 256, 0, 2048, 136]
    check_gmm(torch.bfloat16, counts, 2048, 768, True, backend, "cuda")
    check_gmm(torch.bfloat16, counts, 768, 2048, False, backend, "cuda")
    if backend != "torch":  # _grouped_mm's CUTLASS kernel is bf16 only
        check_gmm(torch.float32, counts, 2048, 768, True, backend, "cuda")
        check_gmm(torch.float32, [5, 0, 77, 3], 100, 36, False, backend, "cuda")  # dims no multiple of 8


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gmm_under_cuda_graph_capture_keeps_the_sizes_on_the_device(dtype):
    """A CUDA graph cannot read device values on the host: "auto" (``_grouped_mm`` in bf16, the Triton
    kernel in float32) is captured, forward and backward, and replays the reference for new group sizes;
    the loop backend, which reads them on the host, raises an error naming the device-side ones."""
    tpe = torch.tensor([3, 0, 5, 8], device="cuda")
    x = torch.randn(16, 64, device="cuda", dtype=dtype, requires_grad=True)
    w = torch.randn(4, 32, 64, device="cuda", dtype=dtype, requires_grad=True)
    dy = torch.randn(16, 32, device="cuda", dtype=dtype)
    gmm(x, w, tpe, trans_w=True).backward(dy)  # warm-up outside the capture (workspaces, Triton's compile)
    x.grad = w.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gmm(x, w, tpe, trans_w=True)
        out.backward(dy)
    tpe.copy_(torch.tensor([8, 4, 0, 4]))
    graph.replay()
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = gmm_reference(x64, w64, tpe.cpu(), trans_w=True)
    ref.backward(dy.double())
    tol = {"atol": 0.1, "rtol": 2e-2} if dtype == torch.bfloat16 else {"atol": 1e-4, "rtol": 1e-4}
    for got, want in ((out, ref), (x.grad, x64.grad), (w.grad, w64.grad)):
        torch.testing.assert_close(got.double(), want, **tol)
    host = r"'loop' backend reads tokens_per_expert on the host.*'triton' and 'torch' backends"
    with pytest.raises(RuntimeError, match=host), torch.cuda.graph(torch.cuda.CUDAGraph()):
        gmm(x.detach(), w.detach(), tpe, trans_w=True, backend="loop")
