"""LR schedules: values at key steps against closed forms; optimizers' param groups."""

from __future__ import annotations

import math

import pytest
import torch
from plait.loop import LRScheduleConfig, LRSegment, PiecewiseLR, build_optimizer, param_groups, plot_schedule
from plait.loop.config import AdamWConfig, SGDConfig, StochasticAdamWConfig
from torch import nn


def _sched(*segments: LRSegment, steps: int = 100) -> tuple[PiecewiseLR, torch.optim.Optimizer]:
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=2.0)
    return PiecewiseLR(opt, LRScheduleConfig(segments=segments), steps), opt


def _lrs(sched: PiecewiseLR, n: int) -> list[float]:
    out = []
    for _ in range(n):
        out.append(sched.get_last_lr()[0])
        sched.step()
    return out


def test_warmup_then_cosine_by_fraction():
    sched, _ = _sched(LRSegment(kind="linear", duration=0.1, start=0.0), LRSegment(kind="cosine", end=0.1))
    lrs = _lrs(sched, 101)
    assert lrs[0] == 0.0
    assert lrs[5] == pytest.approx(2.0 * 5 / 10)
    assert lrs[10] == pytest.approx(2.0)  # cosine starts at the peak
    t = (55 - 10) / 90
    assert lrs[55] == pytest.approx(2.0 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t))))
    assert lrs[100] == pytest.approx(0.2)  # past the end: the final value


def test_constant_exponential_polynomial_by_steps():
    sched, _ = _sched(
        LRSegment(kind="constant", duration=10, start=0.5),
        LRSegment(kind="exponential", duration=20, start=1.0, end=0.01),
        LRSegment(kind="polynomial", duration=None, end=0.0, power=2.0),
        steps=50,
    )
    lrs = _lrs(sched, 50)
    assert lrs[0] == lrs[9] == pytest.approx(1.0)
    assert lrs[10] == pytest.approx(2.0)
    assert lrs[20] == pytest.approx(2.0 * 0.01**0.5)
    # polynomial continues from 0.01 (start=None) towards 0 over the last 20 steps
    assert lrs[30] == pytest.approx(2.0 * 0.01)
    assert lrs[40] == pytest.approx(2.0 * 0.01 * (1 - 10 / 20) ** 2)


def test_state_dict_resumes_lr():
    sched, opt = _sched(LRSegment(kind="linear", duration=None, start=1.0, end=0.0))
    _lrs(sched, 37)
    sched2, opt2 = _sched(LRSegment(kind="linear", duration=None, start=1.0, end=0.0))
    sched2.load_state_dict(sched.state_dict())
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"] == pytest.approx(2.0 * (1 - 37 / 100))


def test_schedule_errors():
    with pytest.raises(ValueError, match="only one segment"):
        LRScheduleConfig(segments=(LRSegment(kind="constant"), LRSegment(kind="constant")))
    with pytest.raises(ValueError, match=r"more than run\.steps=10"):
        LRScheduleConfig(segments=(LRSegment(kind="constant", duration=20),)).resolve(10)
    with pytest.raises(ValueError, match="exponential"):
        LRSegment(kind="exponential", start=0.0, end=1.0)


def test_plot_writes_png(tmp_path):
    plot_schedule(LRScheduleConfig(), 50, str(tmp_path / "lr.png"), base_lr=3e-4)
    assert (tmp_path / "lr.png").read_bytes()[:4] == b"\x89PNG"


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(4, 3)
        self.proj = nn.Linear(3, 3)
        self.norm = nn.LayerNorm(3)
        self.head = nn.Linear(3, 4, bias=False)


def test_param_groups_exclude_norms_biases_embeddings():
    net = _Net()
    decay, no_decay = param_groups(net, 0.1)
    assert {id(p) for p in decay["params"]} == {id(net.proj.weight), id(net.head.weight)}
    assert {id(p) for p in no_decay["params"]} == {
        id(net.tok_embeddings.weight),
        id(net.proj.bias),
        id(net.norm.weight),
        id(net.norm.bias),
    }
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.1, 0.0)


def test_build_optimizers():
    net = _Net()
    adamw = build_optimizer(AdamWConfig(lr=1e-3), net)
    assert isinstance(adamw, torch.optim.AdamW) and not adamw.defaults["fused"]  # CPU: not fused
    sgd = build_optimizer(SGDConfig(lr=0.1, momentum=0.9), net)
    assert isinstance(sgd, torch.optim.SGD) and sgd.defaults["momentum"] == 0.9
    from plait.kernels import StochasticAdamW

    sr = build_optimizer(StochasticAdamWConfig(lr=1e-3, weight_decay=0.0), net)
    assert isinstance(sr, StochasticAdamW) and len(sr.param_groups) == 2
    # With fp32 parameters it is exact AdamW: compare one step against torch's.
    ref_net = _Net()
    ref_net.load_state_dict(net.state_dict())
    ref = torch.optim.AdamW(ref_net.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0)
    for m, o in ((net, sr), (ref_net, ref)):
        for p in m.parameters():
            p.grad = torch.ones_like(p)
        o.step()
    for a, b in zip(net.parameters(), ref_net.parameters()):
        torch.testing.assert_close(a, b)
    for p in net.parameters():
        p.requires_grad_(False)
    with pytest.raises(ValueError, match="no parameter with requires_grad"):
        build_optimizer(SGDConfig(), net)


def _fused_mixed_step() -> list[torch.Tensor]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    results = []
    for fused in (False, True):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
        net[0].weight = nn.Parameter(distribute_tensor(net[0].weight.detach(), mesh, [Replicate()]))
        net[0].bias = nn.Parameter(distribute_tensor(net[0].bias.detach(), mesh, [Replicate()]))
        opt = build_optimizer(AdamWConfig(lr=0.1, fused=fused), net)
        for p in net.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
        results += [p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for p in net.parameters()]
    return results


def test_fused_adamw_takes_dtensor_and_plain_parameters_together():
    # Tensor parallelism without FSDP leaves norms plain: one fused call over both kinds is refused
    # by DTensor's dispatch, so the groups are split by kind (the update is the unfused one).
    from plait.dist_core.testing import run_distributed

    (params,) = run_distributed(_fused_mixed_step, 1)
    half = len(params) // 2
    for fused, plain in zip(params[half:], params[:half], strict=True):
        torch.testing.assert_close(fused, plain)
