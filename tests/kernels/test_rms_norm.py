"""RMSNorm (weight, offset, fused residual, fp32 stats) vs a float64 reference."""

from __future__ import annotations

import pytest
import torch
from plait.kernels import rms_norm
from plait.kernels._dispatch import use_triton

from tests.kernels.conftest import TOL, to64


def _ref(x, w, eps, offset, r):
    h = x if r is None else x + r
    y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if w is not None:
        y = y * (w + offset)
    return y, h


def check_rms_norm(dtype, shape, offset, with_res, with_w=True, device="cpu"):
    torch.manual_seed(0)
    x = torch.randn(shape, dtype=dtype, device=device, requires_grad=True)
    w = (torch.randn(shape[-1], dtype=dtype, device=device) * 0.5).requires_grad_() if with_w else None
    r = torch.randn(shape, dtype=dtype, device=device, requires_grad=True) if with_res else None
    out = rms_norm(x, w, 1e-5, offset, r)
    y, h = out if with_res else (out, None)
    assert y.dtype == dtype and y.shape == shape
    dy = torch.randn_like(y)
    dh = torch.randn_like(y)
    loss = (y.float() * dy.float()).sum() + ((h.float() * dh.float()).sum() if with_res else 0)
    loss.backward()
    x64, w64, r64 = to64(x, w, r)
    y64, h64 = _ref(x64, w64, 1e-5, offset, r64)
    loss64 = (y64 * dy.double()).sum() + ((h64 * dh.double()).sum() if with_res else 0)
    loss64.backward()
    tol = TOL[dtype]
    torch.testing.assert_close(y.double(), y64, **tol)
    if with_res:
        torch.testing.assert_close(h.double(), h64, **tol)
        torch.testing.assert_close(r.grad.double(), r64.grad, **tol)
    torch.testing.assert_close(x.grad.double(), x64.grad, **tol)
    if with_w:
        n_rows = x.numel() // shape[-1]
        atol = 1e-4 if dtype == torch.float32 else 0.03 * n_rows**0.5
        torch.testing.assert_close(w.grad.double(), w64.grad, atol=atol, rtol=tol["rtol"])
    return use_triton(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "shape,offset,with_res,with_w",
    [((1, 37), 0.0, False, True), ((3, 5, 24), 1.0, True, True), ((6, 19), 0.0, True, False)],
)
def test_rms_norm_matches_float64(run, dtype, shape, offset, with_res, with_w):
    assert run(check_rms_norm, dtype, shape, offset, with_res, with_w) == (run.path == "triton")


def test_rms_norm_fp32_stats_for_bf16():
    # Large-magnitude bf16 rows: the mean square must be accumulated in fp32 (bf16 would overflow/lose precision).
    x = torch.full((2, 4096), 300.0, dtype=torch.bfloat16)
    y = rms_norm(x, torch.ones(4096, dtype=torch.bfloat16))
    torch.testing.assert_close(y.float(), torch.ones(2, 4096))


def test_rms_norm_bad_input():
    with pytest.raises(ValueError, match="weight shape"):
        rms_norm(torch.randn(2, 8), torch.ones(7))
    with pytest.raises(ValueError, match="residual"):
        rms_norm(torch.randn(2, 8), torch.ones(8), residual=torch.randn(2, 7))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_gpu_real_shapes(dtype):
    assert check_rms_norm(dtype, (2048, 4096), 0.0, False, True, "cuda")
    assert check_rms_norm(dtype, (4, 513, 5120), 1.0, True, True, "cuda")
