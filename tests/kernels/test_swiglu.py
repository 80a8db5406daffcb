"""SwiGLU (separate and fused layouts, optional row weight) vs a float64 reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from plait.kernels import swiglu, swiglu_fused
from plait.kernels._dispatch import use_triton

from tests.kernels.conftest import TOL, to64


def _ref(g, u, w):
    y = F.silu(g) * u
    return y * w.unsqueeze(-1) if w is not None else y


def check_swiglu(dtype, shape, with_w, device="cpu"):
    torch.manual_seed(0)
    g = torch.randn(shape, dtype=dtype, device=device, requires_grad=True)
    u = torch.randn(shape, dtype=dtype, device=device, requires_grad=True)
    w = torch.rand(shape[:-1], device=device, requires_grad=True) if with_w else None
    y = swiglu(g, u, w)
    assert y.dtype == dtype and y.shape == shape
    dy = torch.randn_like(y)
    y.backward(dy)
    g64, u64, w64 = to64(g, u, w)
    y64 = _ref(g64, u64, w64)
    y64.backward(dy.double())
    tol = TOL[dtype]
    torch.testing.assert_close(y.double(), y64, **tol)
    torch.testing.assert_close(g.grad.double(), g64.grad, **tol)
    torch.testing.assert_close(u.grad.double(), u64.grad, **tol)
    if with_w:
        # A sum over the row: bf16 error grows with its length.
        atol = 1e-4 if dtype == torch.float32 else 0.05 * shape[-1] ** 0.5
        torch.testing.assert_close(w.grad.double(), w64.grad, atol=atol, rtol=tol["rtol"])
    return use_triton(g)


def check_swiglu_fused(dtype, device="cpu"):
    torch.manual_seed(1)
    gu = torch.randn(4, 2 * 19, dtype=dtype, device=device, requires_grad=True)
    w = torch.rand(4, device=device, requires_grad=True)
    y = swiglu_fused(gu, w)
    dy = torch.randn_like(y)
    y.backward(dy)
    gu64, w64 = to64(gu, w)
    g, u = gu64.chunk(2, -1)
    _ref(g, u, w64).backward(dy.double())
    torch.testing.assert_close(y.double(), _ref(*to64(*gu.chunk(2, -1)), w64.detach()).detach(), **TOL[dtype])
    assert gu.grad.shape == gu.shape
    torch.testing.assert_close(gu.grad.double(), gu64.grad, **TOL[dtype])
    torch.testing.assert_close(
        w.grad.double(), w64.grad, atol=0.2 if dtype == torch.bfloat16 else 1e-4, rtol=2e-2
    )
    return use_triton(gu)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# (2, 8200): two column blocks per row, the row weight's gradient summed over them
@pytest.mark.parametrize("shape,with_w", [((1, 7), False), ((3, 5, 37), True), ((2, 8200), True)])
def test_swiglu_matches_float64(run, dtype, shape, with_w):
    assert run(check_swiglu, dtype, shape, with_w) == (run.path == "triton")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_fused_layout(run, dtype):
    assert run(check_swiglu_fused, dtype) == (run.path == "triton")


def check_swiglu_num_rows(dtype, rows, cols, used, compiled, device="cpu"):
    """Rows ``< used`` equal float64, forward and backward, whatever the rows past them hold (NaN here,
    in the input and in the output gradient); eager and compiled (the op with ``num_rows`` in the graph)."""
    torch.manual_seed(2)
    gu = torch.randn(rows, 2 * cols, dtype=dtype, device=device)
    gu[used:] = float("nan")
    gu.requires_grad_()
    w = torch.rand(rows, device=device, requires_grad=True)
    n = torch.tensor([used], device=device)
    fn = torch.compile(swiglu_fused, fullgraph=True, backend="aot_eager") if compiled else swiglu_fused
    y = fn(gu, w, num_rows=n)
    dy = torch.randn_like(y)
    dy[used:] = float("nan")
    y.backward(dy)
    gu64, w64 = to64(gu[:used], w[:used])
    g, u = gu64.chunk(2, -1)
    y64 = _ref(g, u, w64)
    y64.backward(dy[:used].double())
    torch.testing.assert_close(y[:used].double(), y64, **TOL[dtype])
    torch.testing.assert_close(gu.grad[:used].double(), gu64.grad, **TOL[dtype])
    torch.testing.assert_close(
        w.grad[:used].double(), w64.grad, atol=0.2 if dtype == torch.bfloat16 else 1e-4, rtol=2e-2
    )
    return use_triton(gu)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# 3 of 20 rows of 19 columns (several rows per program); 0 rows; all rows; 2 of 5 rows of 2100
# columns (two column blocks with the row weight's gradient)
@pytest.mark.parametrize("rows,cols,used", [(20, 19, 3), (20, 19, 0), (20, 19, 20), (5, 2100, 2)])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_swiglu_num_rows_computes_the_first_rows(run, dtype, rows, cols, used, compiled):
    assert run(check_swiglu_num_rows, dtype, rows, cols, used, compiled) == (run.path == "triton")


def test_swiglu_bad_input():
    with pytest.raises(ValueError, match="same shape"):
        swiglu(torch.randn(2, 3), torch.randn(2, 4))
    with pytest.raises(ValueError, match="row_weight"):
        swiglu(torch.randn(2, 3), torch.randn(2, 3), torch.randn(3))
    with pytest.raises(ValueError, match="even"):
        swiglu_fused(torch.randn(2, 3))
    with pytest.raises(ValueError, match="num_rows"):
        swiglu_fused(torch.randn(2, 4), num_rows=torch.tensor([1.0]))
    with pytest.raises(ValueError, match="num_rows"):
        swiglu_fused(torch.randn(2, 4), num_rows=torch.tensor([1, 2]))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_gpu_real_shapes(dtype):
    assert check_swiglu(dtype, (4096, 8192 // 4), True, "cuda")
    assert check_swiglu(dtype, (3, 1000, 768), False, "cuda")
    assert check_swiglu_fused(dtype, "cuda")
    assert check_swiglu_num_rows(dtype, 4096, 512, 1500, False, "cuda")
