"""replicate / FSDP2 / HSDP against a single-process reference: gradients, norms, clipping."""

from __future__ import annotations

import pytest
import torch
from plait.dist_core import (
    DeviceMeshParameters,
    DistributedContext,
    all_reduce_grads,
    clip_grad_norm_,
    fully_shard_module,
    global_grad_norm,
    is_replicated,
    prefetch_all_gathers,
    replicate,
    replicated_reduce,
    set_gradient_sync,
)
from plait.dist_core.testing import run_distributed
from torch import nn


def _model() -> nn.Module:
    torch.manual_seed(0)
    # 5 output rows: FSDP shards them unevenly over 2 or 4 ranks
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))


def _inputs(world: int, micro: int = 1) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [[torch.randn(3, 4, generator=g) for _ in range(micro)] for _ in range(world)]


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).pow(2).mean()


def _reference(xs: list[list[torch.Tensor]], reduce: str) -> tuple[dict[str, torch.Tensor], float]:
    """Single process: gradients of (mean or sum over ranks of) the per-rank losses, float64."""
    model = _model().double()
    losses = [_loss(model, x.double()) for rank_xs in xs for x in rank_xs]
    total = torch.stack(losses).sum()
    if reduce == "mean":
        total = total / len(xs)
    total.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return grads, float(torch.nn.utils.get_total_norm(list(grads.values())))


def _parallel_step(
    mode: str, config: dict[str, int], xs: list[list[torch.Tensor]], reduce: str, device: str = "cpu"
) -> dict[str, object]:
    ctx = DistributedContext.from_env(DeviceMeshParameters(**config), device=device)
    model = _model().to(ctx.device)
    dense = ctx.mesh_for("dense")
    if mode == "replicate":
        replicate(model, dense["dp_replicate"], reduce=reduce, bucket_cap_mb=1e-4)  # tiny buckets: several
    else:
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard_module(layer, dense, reduce=reduce)
        fully_shard_module(model, dense, reduce=reduce)
    my_xs = xs[ctx.rank]
    for i, x in enumerate(my_xs):  # gradient accumulation: sync only on the last micro-batch
        set_gradient_sync(model, i == len(my_xs) - 1)
        _loss(model, x.to(ctx.device)).backward()
    params = list(model.parameters())
    out: dict[str, object] = {
        "placements": [str(p.placements) for p in params],
        "grads": {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()},  # before clipping
        "norm": global_grad_norm(params).item(),
        "replicated": is_replicated(model),
        "reduce": replicated_reduce(model) if mode == "replicate" else None,
    }
    clip_grad_norm_(params, 0.1)
    out["clipped"] = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    ctx.shutdown()
    return out


CASES = [
    ("replicate", {"data_replicate": 2}, "mean", 2),
    ("fsdp", {"data_shard": 4}, "mean", 1),
    ("hsdp", {"data_replicate": 2, "data_shard": 2}, "sum", 2),
]


@pytest.mark.parametrize(("mode", "config", "reduce", "micro"), CASES, ids=[c[0] for c in CASES])
def test_gradients_and_norm_match_single_process(
    mode: str, config: dict[str, int], reduce: str, micro: int
) -> None:
    check_parallel_step(mode, config, reduce, micro)


def check_parallel_step(
    mode: str, config: dict[str, int], reduce: str, micro: int, backend: str = "gloo", device: str = "cpu"
) -> None:
    world = DeviceMeshParameters(**config).world_size
    xs = _inputs(world, micro)
    ref_grads, ref_norm = _reference(xs, reduce)
    coef = min(1.0, 0.1 / (ref_norm + 1e-6))
    kind = "replicate" if mode == "replicate" else "fsdp"
    for res in run_distributed(_parallel_step, world, kind, config, xs, reduce, device, backend=backend):
        expected = "Replicate()" if mode == "replicate" else "Shard(dim=0)"
        assert all(expected in p for p in res["placements"]), res["placements"]
        assert res["replicated"] == (mode == "replicate")
        assert res["reduce"] == (reduce if mode == "replicate" else None)
        for name, g in res["grads"].items():
            torch.testing.assert_close(g.double(), ref_grads[name], rtol=1e-5, atol=1e-6)
        assert res["norm"] == pytest.approx(ref_norm, rel=1e-5)
        for name, g in res["clipped"].items():
            torch.testing.assert_close(g.double(), ref_grads[name] * coef, rtol=1e-5, atol=1e-6)


def test_bad_reduce_and_cp_replicate() -> None:
    with pytest.raises(ValueError, match="reduce must be 'mean' or 'sum'"):
        replicate(nn.Linear(2, 2), None, reduce="avg")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="Linear was not parallelized"):
        set_gradient_sync(nn.Linear(2, 2), False)
    assert not is_replicated(nn.Linear(2, 2))
    with pytest.raises(TypeError, match="Linear was not parallelized with replicate"):
        replicated_reduce(nn.Linear(2, 2))


class _Mixed(nn.Module):
    """float32 and float64 layers, one used on rank 0 only, one frozen parameter."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(4, 3)
        self.b = nn.Linear(3, 2).double()
        self.c = nn.Linear(2, 2)
        self.scale = nn.Parameter(torch.full((2,), 1.5), requires_grad=False)

    def forward(self, x: torch.Tensor, use_c: bool) -> torch.Tensor:
        h = self.b(torch.tanh(self.a(x)).double()).float()
        if use_c:
            h = self.c(h)
        return (h * self.scale).pow(2).sum()


def _all_reduce_grads_step(xs: list[torch.Tensor]) -> dict[str, torch.Tensor | None]:
    ctx = DistributedContext.from_env(DeviceMeshParameters(data_replicate=2))
    model = _Mixed()
    model(xs[ctx.rank], use_c=ctx.rank == 0).backward()
    assert (model.c.weight.grad is None) == (ctx.rank == 1)
    all_reduce_grads(model.parameters(), bucket_cap_mb=1e-5)  # tiny buckets: one parameter each
    out = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
    ctx.shutdown()
    return out


def test_all_reduce_grads_sums_over_ranks() -> None:
    """Each rank gets the sum of the ranks' gradients, per dtype; an unused parameter receives the
    others' sum; a frozen one keeps no gradient. Reference: both ranks' losses in one process."""
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(5, 4, generator=g) for _ in range(2)]
    ref = _Mixed()
    (ref(xs[0], use_c=True) + ref(xs[1], use_c=False)).backward()
    for res in run_distributed(_all_reduce_grads_step, 2, xs):
        assert res["scale"] is None
        for name, p in ref.named_parameters():
            if p.requires_grad:
                assert res[name].dtype == p.dtype, name
                torch.testing.assert_close(res[name], p.grad, rtol=1e-5, atol=1e-6)


def _prefetched_forward(units: int) -> dict[str, object]:
    """FSDP2 per linear layer and the root over two gloo ranks: one SGD step, the next step's first all-gathers
    started (``units`` of them), then the next forward; the output gathered over the ranks."""
    ctx = DistributedContext.from_env(DeviceMeshParameters(data_shard=2), device="cpu")
    model = _model()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard_module(layer, ctx.mesh_for("dense"), reduce="sum")
    fully_shard_module(model, ctx.mesh_for("dense"), reduce="sum")
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    xs = _inputs(2)
    _loss(model, xs[ctx.rank][0]).backward()
    opt.step()
    asked = prefetch_all_gathers(model, units)
    out = model(torch.cat([x[0] for x in xs])).detach()
    names = {id(m): n for n, m in model.named_modules()}
    ctx.shutdown()
    return {"asked": [names[id(m)] for m in asked], "out": out}


def test_prefetched_all_gathers_feed_the_next_forward_with_the_updated_parameters() -> None:
    xs = _inputs(2)
    ref = _model().double()  # the same SGD step on the summed losses, float64, one process
    sum(_loss(ref, x[0].double()) for x in xs).backward()
    with torch.no_grad():
        for p in ref.parameters():
            p -= 0.5 * p.grad
        want = ref(torch.cat([x[0] for x in xs]).double())
    for units, first in ((2, ["0", "2"]), (5, ["0", "2", "4"]), (0, [])):
        for res in run_distributed(_prefetched_forward, 2, units):
            assert res["asked"] == first  # module order; the root holds no parameters of its own
            torch.testing.assert_close(res["out"].double(), want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="units must be >= 0"):
        prefetch_all_gathers(_model(), -1)
