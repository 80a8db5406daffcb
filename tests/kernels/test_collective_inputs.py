"""Kernels fed what tensor parallelism hands them: the ``AsyncCollectiveTensor`` of a functional
all-reduce (a vocab-parallel embedding's or a row-parallel linear's output) and DTensors.

A Triton kernel given the wrapper reads no storage (on a GPU: an illegal memory access); each op
must wait for the collective and give the float64 reference's values and gradients.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from plait.kernels import rms_norm, swiglu
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

from tests.kernels.conftest import TOL


def _rms64(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5) * w


def check_collective_inputs() -> dict[str, bool]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        x = torch.randn(4, 6, 24, requires_grad=True)
        r = torch.randn(4, 6, 24, requires_grad=True)
        w = torch.randn(24, requires_grad=True)
        g = torch.randn(5, 16, requires_grad=True)
        u = torch.randn(5, 16, requires_grad=True)
        reduced = {
            n: funcol.all_reduce(t * 1.0, "sum", dist.group.WORLD)
            for n, t in {"x": x, "r": r, "g": g}.items()
        }
        assert all(isinstance(t, funcol.AsyncCollectiveTensor) for t in reduced.values())
        y = rms_norm(reduced["x"], w, 1e-5)
        y2, h2 = rms_norm(reduced["x"], w, 1e-5, residual=reduced["r"])
        s = swiglu(reduced["g"], u)
        ((y * 1.5).sum() + (y2 * y2).sum() + (h2 * 0.5).sum() + (s * s).sum()).backward()

        x64, r64, w64, g64, u64 = (t.detach().double().requires_grad_() for t in (x, r, w, g, u))
        y64, h64 = _rms64(x64, w64), x64 + r64
        y264, s64 = _rms64(h64, w64), torch.nn.functional.silu(g64) * u64
        ((y64 * 1.5).sum() + (y264 * y264).sum() + (h64 * 0.5).sum() + (s64 * s64).sum()).backward()
        tol = TOL[torch.float32]
        for ours, ref in ((y, y64), (y2, y264), (h2, h64), (s, s64)):
            assert type(ours) is torch.Tensor
            torch.testing.assert_close(ours.double(), ref, **tol)
        for ours, ref in ((x, x64), (r, r64), (w, w64), (g, g64), (u, u64)):
            torch.testing.assert_close(ours.grad.double(), ref.grad, **tol)

        # A replicated DTensor takes the PyTorch formula through DTensor's dispatch.
        mesh = init_device_mesh("cpu", (1,))
        xd = distribute_tensor(x.detach(), mesh, [Replicate()])
        wd = distribute_tensor(w.detach(), mesh, [Replicate()])
        yd = rms_norm(xd, wd, 1e-5)
        assert isinstance(yd, DTensor)
        torch.testing.assert_close(yd.full_tensor().double(), _rms64(x64, w64).detach(), **tol)
    finally:
        dist.destroy_process_group()
    return {"ok": True}


def test_kernels_wait_for_a_functional_collective_and_run_dtensors(run):
    assert run(check_collective_inputs) == {"ok": True}
