"""Expert parallelism (all-to-all over gloo, CPU) against the single-process float64 reference."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.utils._python_dispatch
from plait.dist_core.testing import run_distributed
from plait.moe import (
    AllGatherDispatcher,
    AllToAllDispatcher,
    DeepEPDispatcher,
    ExpertDispatch,
    LocalDispatcher,
    MoELayer,
    RouterConfig,
    expert_parallel,
    switch_aux_loss_from_stats,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from ._fake_deep_ep import fake_deep_ep
from ._reference import reference_moe

H, FFN, E, T = 8, 6, 8, 12


def _inputs(world: int, seed: int, one_hot_expert: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(world, T, H, generator=g)
    if one_hot_expert is not None:
        x[..., 0] = x[..., 0].abs() + 1.0
    return x, torch.randn(world, T, H, generator=g)


def _make_layer(
    seed: int, layer_kwargs: dict[str, Any], router_kwargs: dict[str, Any], one_hot_expert: int | None
) -> MoELayer:
    torch.manual_seed(seed)
    layer = MoELayer(H, FFN, E, RouterConfig(**router_kwargs), **layer_kwargs)
    if one_hot_expert is not None:
        with torch.no_grad():
            layer.router.weight.zero_()
            layer.router.weight[one_hot_expert, 0] = 20.0
    return layer


@contextlib.contextmanager
def _count_collectives() -> Iterator[dict[str, int]]:
    """Count ``dist.all_to_all_single`` calls and device-to-host ``Tensor.tolist`` copies."""
    calls = {"all_to_all_single": 0, "tolist": 0}
    a2a, tolist = dist.all_to_all_single, torch.Tensor.tolist

    def counted_a2a(*args: Any, **kwargs: Any) -> Any:
        calls["all_to_all_single"] += 1
        return a2a(*args, **kwargs)

    def counted_tolist(self: torch.Tensor) -> Any:
        calls["tolist"] += 1
        return tolist(self)

    dist.all_to_all_single, torch.Tensor.tolist = counted_a2a, counted_tolist  # type: ignore[method-assign]
    try:
        yield calls
    finally:
        dist.all_to_all_single, torch.Tensor.tolist = a2a, tolist  # type: ignore[method-assign]


def _ep_worker(
    seed: int,
    layer_kwargs: dict[str, Any],
    router_kwargs: dict[str, Any],
    one_hot_expert: int | None,
    device: str = "cpu",
    backend: ExpertDispatch = "all_to_all",
    num_chunks: int | None = None,
    buffer_factor: float | None = None,
) -> dict[str, Any]:
    if backend != "deepep":
        return _ep_run(
            seed, layer_kwargs, router_kwargs, one_hot_expert, device, backend, num_chunks, buffer_factor
        )
    with fake_deep_ep() as buffer:  # DeepEP's Buffer API over gloo (tests/moe/_fake_deep_ep.py)
        result = _ep_run(seed, layer_kwargs, router_kwargs, one_hot_expert, device, backend, num_chunks)
    # forward dispatch and combine, then their backwards (combine's is a cached dispatch).
    assert buffer.calls == ["dispatch", "combine", "dispatch", "combine"], buffer.calls
    return result


def _assert_no_host_sync(router_kwargs: dict[str, Any], layer_kwargs: dict[str, Any], mesh: Any) -> None:
    """On CUDA, an all-gather-dispatch step (forward and backward) never makes the host wait for the device.

    Run in bf16 at shapes the grouped GEMM's CUDA kernel takes (the fp32 test layer's odd sizes take the
    per-expert loop, which reads the group sizes on the host).
    """
    torch.manual_seed(0)
    layer = MoELayer(64, 64, E, RouterConfig(**router_kwargs), **layer_kwargs).to("cuda", torch.bfloat16)
    expert_parallel(layer, mesh, backend="all_gather")
    x = torch.randn(256, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    for debug_mode in ("default", "error"):  # a first step (lazy initialisation may sync), then the check
        torch.cuda.set_sync_debug_mode(debug_mode)
        try:
            out = layer(x)
            (out.hidden_states.float().square().mean() + out.aux_loss).backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")


def _ep_run(
    seed: int,
    layer_kwargs: dict[str, Any],
    router_kwargs: dict[str, Any],
    one_hot_expert: int | None,
    device: str,
    backend: ExpertDispatch,
    num_chunks: int | None,
    buffer_factor: float | None = None,
) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    layer = _make_layer(seed, layer_kwargs, router_kwargs, one_hot_expert).to(device)
    mesh = init_device_mesh(device, (world,), mesh_dim_names=("ep",))
    expert_parallel(layer, mesh, backend=backend, num_chunks=num_chunks, buffer_factor=buffer_factor)
    expected = {"deepep": DeepEPDispatcher, "all_gather": AllGatherDispatcher}.get(
        backend, AllToAllDispatcher
    )
    assert isinstance(layer.dispatcher, expected)
    w = layer.experts.gate_up_proj
    assert isinstance(w, DTensor) and w.placements == (Shard(0),) and w.to_local().shape[0] == E // world
    x_all, g_all = _inputs(world, seed, one_hot_expert)
    x = x_all[rank].to(device).requires_grad_()
    if backend == "all_gather" and device == "cpu":
        with _count_collectives() as calls:
            out = layer(x)
        # No host copy of the dispatch's own (the CPU grouped-GEMM reference still reads its group sizes:
        # 2 host copies per chunk, at most one chunk per token); its exchanges are functional
        # all-gathers and reduce-scatters.
        chunks = min(num_chunks or 1, x.shape[0])
        assert calls == {"all_to_all_single": 0, "tolist": 2 * chunks}, calls
    elif backend == "all_gather":
        _assert_no_host_sync(router_kwargs, layer_kwargs, mesh)
        out = layer(x)
    elif num_chunks is None or device != "cpu":
        out = layer(x)
    else:
        with _count_collectives() as calls:
            out = layer(x)
        # One counts exchange and one host copy of the split sizes for all chunks, then rows and
        # weights of each chunk out and its results back (the CPU grouped-GEMM reference reads its
        # group sizes too: 2 host copies per chunk).
        assert calls == {"all_to_all_single": 1 + 3 * num_chunks, "tolist": 1 + 2 * num_chunks}, calls
    ((out.hidden_states * g_all[rank].to(device)).sum() + out.aux_loss).backward()
    grads = {}
    for name, p in layer.named_parameters():
        grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        grads[name] = grad.clone()
    result = {"y": out.hidden_states.detach(), "gx": x.grad, "aux": out.aux_loss.detach(), "grads": grads}
    if layer.router.expert_bias is not None:
        # A 2-D data-parallel mesh is reduced over all of its dims; a 1-D one over its only dim.
        dp = init_device_mesh(device, (2, world // 2), mesh_dim_names=("a", "b")) if world == 4 else mesh
        result["bias_counts"] = layer.update_expert_bias(dp)
        result["bias"] = layer.router.expert_bias.clone()
    return result


def _check(
    world: int,
    seed: int,
    layer_kwargs: dict[str, Any],
    router_kwargs: dict[str, Any],
    one_hot_expert: int | None = None,
    device: str = "cpu",
    dispatch: ExpertDispatch = "all_to_all",
    num_chunks: int | None = None,
    buffer_factor: float | None = None,
) -> None:
    backend = "nccl" if device == "cuda" else "gloo"
    results = run_distributed(
        _ep_worker,
        world,
        seed,
        layer_kwargs,
        router_kwargs,
        one_hot_expert,
        device,
        dispatch,
        num_chunks,
        buffer_factor,
        backend=backend,
    )
    layer = _make_layer(seed, layer_kwargs, router_kwargs, one_hot_expert)
    params = {k: v.detach().double().requires_grad_() for k, v in layer.named_parameters()}
    x_all, g_all = _inputs(world, seed, one_hot_expert)
    ref_kwargs = {
        "top_k": router_kwargs["top_k"],
        "norm_topk_prob": router_kwargs.get("norm_topk_prob", False),
        "aux_loss_coef": router_kwargs.get("aux_loss_coef", 0.0),
        "capacity_factor": layer_kwargs.get("capacity_factor"),
        "drop_policy": layer_kwargs.get("drop_policy", "probs"),
    }
    total_counts = torch.zeros(E, dtype=torch.int64)
    for rank, res in enumerate(results):
        x = x_all[rank].double().requires_grad_()
        y, aux, counts = reference_moe(x, params, **ref_kwargs)
        total_counts += counts
        ((y * g_all[rank].double()).sum() + aux).backward()
        torch.testing.assert_close(
            res["y"].double(), y.detach(), rtol=1e-5, atol=1e-5, msg=f"rank {rank} output"
        )
        torch.testing.assert_close(res["aux"].double(), aux.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(
            res["gx"].double(), x.grad, rtol=1e-5, atol=1e-5, msg=f"rank {rank} input grad"
        )
    n_local = E // world
    for name, ref in params.items():
        if name.startswith("experts."):
            got = torch.cat([r["grads"][name] for r in results])  # each rank owns a slice of experts
        else:
            got = sum(r["grads"][name] for r in results)  # replicated: per-rank partial sums
        assert got.shape == ref.shape
        torch.testing.assert_close(got.double(), ref.grad, rtol=1e-4, atol=1e-5, msg=name)
    if router_kwargs.get("bias_update_rate"):
        rate = router_kwargs["bias_update_rate"]
        c = total_counts.double()
        for res in results:
            assert torch.equal(res["bias_counts"], total_counts)
            torch.testing.assert_close(res["bias"].double(), rate * torch.sign(c.mean() - c))
    assert n_local * world == E


def test_ep2_matches_reference() -> None:
    _check(
        2,
        seed=0,
        layer_kwargs={"shared_expert_intermediate_size": 5, "shared_expert_gate": True},
        router_kwargs={"top_k": 2, "norm_topk_prob": True, "aux_loss_coef": 0.05, "bias_update_rate": 0.01},
    )


def test_ep2_one_hot_expert_and_capacity() -> None:
    # Every token picks expert 5 (rank 1): rank 0's experts receive nothing from anyone.
    _check(2, seed=1, layer_kwargs={}, router_kwargs={"top_k": 1}, one_hot_expert=5)
    _check(2, seed=2, layer_kwargs={"capacity_factor": 0.75}, router_kwargs={"top_k": 2})


def test_ep4_matches_reference() -> None:
    _check(
        4,
        seed=3,
        layer_kwargs={"capacity_factor": 1.0, "drop_policy": "position"},
        router_kwargs={"top_k": 3, "aux_loss_coef": 0.1, "bias_update_rate": 0.02},
    )


@pytest.mark.parametrize("num_chunks", [1, 3, 16])
def test_ep2_chunked_matches_reference(num_chunks: int) -> None:
    """Chunked (pipelined) dispatch: same float64 parity; 16 chunks of 12 tokens leave 4 empty."""
    _check(
        2,
        seed=5,
        layer_kwargs={"shared_expert_intermediate_size": 5, "capacity_factor": 0.75},
        router_kwargs={"top_k": 2, "norm_topk_prob": True, "aux_loss_coef": 0.05},
        num_chunks=num_chunks,
    )
    # Every token on rank 1's expert 5: rank 0 neither sends to nor receives from itself.
    _check(2, seed=6, layer_kwargs={}, router_kwargs={"top_k": 1}, one_hot_expert=5, num_chunks=num_chunks)


@pytest.mark.parametrize(("world", "num_chunks"), [(2, None), (4, None), (2, 3), (2, 16)])
def test_all_gather_dispatch_matches_reference(world: int, num_chunks: int | None) -> None:
    """Tokens all-gathered, outputs reduce-scattered (no host read of any size): the same float64
    parity, with dropped slots (capacity), a rank whose experts get no token (one-hot expert), top-k
    above and below E/P; chunked too (16 chunks of 12 tokens: one token per chunk)."""
    _check(
        world,
        seed=9,
        layer_kwargs={"shared_expert_intermediate_size": 5, "capacity_factor": 0.75},
        router_kwargs={"top_k": 3, "norm_topk_prob": True, "aux_loss_coef": 0.05, "bias_update_rate": 0.01},
        dispatch="all_gather",
        num_chunks=num_chunks,
    )
    _check(
        world,
        seed=10,
        layer_kwargs={},
        router_kwargs={"top_k": 1},
        one_hot_expert=5,
        dispatch="all_gather",
        num_chunks=num_chunks,
    )


def test_ep4_chunked_matches_reference() -> None:
    _check(
        4,
        seed=7,
        layer_kwargs={"capacity_factor": 1.0, "drop_policy": "position"},
        router_kwargs={"top_k": 3, "aux_loss_coef": 0.1, "bias_update_rate": 0.02},
        num_chunks=4,
    )


@pytest.mark.multigpu
def test_ep2_nccl_chunked_matches_reference() -> None:
    _check(
        2,
        seed=8,
        layer_kwargs={"capacity_factor": 1.25},
        router_kwargs={"top_k": 2, "norm_topk_prob": True, "aux_loss_coef": 0.05},
        device="cuda",
        num_chunks=4,
    )


@pytest.mark.multigpu
def test_ep2_nccl_all_gather_dispatch_matches_reference_without_host_sync() -> None:
    _check(
        2,
        seed=11,
        layer_kwargs={"capacity_factor": 1.25},
        router_kwargs={"top_k": 2, "norm_topk_prob": True, "aux_loss_coef": 0.05},
        device="cuda",
        dispatch="all_gather",
    )


@pytest.mark.multigpu
def test_ep2_nccl_matches_reference() -> None:
    _check(
        2,
        seed=4,
        layer_kwargs={"capacity_factor": 1.25},
        router_kwargs={"top_k": 2, "norm_topk_prob": True, "aux_loss_coef": 0.05, "bias_update_rate": 0.01},
        device="cuda",
    )


POOL_K, POOL_COEF = 2, 0.1


def _pool_layers() -> list[MoELayer]:
    cfg = RouterConfig(top_k=POOL_K, aux_loss_coef=POOL_COEF, aux_loss_pooling="all_layers")
    torch.manual_seed(11)
    return [MoELayer(H, FFN, E, cfg) for _ in range(2)]


def _pool_inputs(world: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x, g = _inputs(world, 11, None)
    mask = torch.ones(world, T, dtype=torch.bool)
    for rank in range(world):
        mask[rank, : 3 + rank] = False  # rank r: its first 3 + r tokens are padding
    return x, g, mask


def _pooled_ep_worker() -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    layers = _pool_layers()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    for layer in layers:
        expert_parallel(layer, mesh)
    x_all, g_all, mask_all = _pool_inputs(world)
    h, stats = x_all[rank], []
    for layer in layers:
        out = layer(h, token_mask=mask_all[rank])
        h, stats = out.hidden_states, [*stats, out.switch_stats]
    aux = POOL_COEF * switch_aux_loss_from_stats(stats[0] + stats[1])
    ((h * g_all[rank]).sum() + aux).backward()
    grads = {
        f"{i}.{n}": (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).clone()
        for i, layer in enumerate(layers)
        for n, p in layer.named_parameters()
    }
    return {"aux": aux.detach(), "grads": grads}


def test_ep2_all_layers_pooling_with_padding() -> None:
    """Two EP=2 layers pooling their Switch statistics over both layers, padding masked: each rank's
    loss is the pooled loss of its own real tokens (nothing is reduced across ranks, as for the
    per-layer loss) and the gradients match the float64 single-process reference."""
    world = 2
    results = run_distributed(_pooled_ep_worker, world)
    params = [
        {k: v.detach().double().requires_grad_() for k, v in layer.named_parameters()}
        for layer in _pool_layers()
    ]
    x_all, g_all, mask_all = _pool_inputs(world)
    for rank, res in enumerate(results):
        h, real = x_all[rank].double(), mask_all[rank]
        counts, prob_sums = torch.zeros(E, dtype=torch.float64), torch.zeros(E, dtype=torch.float64)
        for p in params:
            probs = torch.softmax(h @ p["router.weight"].T, dim=-1)
            idx = torch.topk(probs, POOL_K, dim=-1).indices
            counts = counts + torch.bincount(idx[real].flatten(), minlength=E)
            prob_sums = prob_sums + probs[real].sum(0)
            h = reference_moe(h, p, top_k=POOL_K)[0]
        rows = 2 * int(real.sum())
        aux = POOL_COEF * E * ((counts / rows) * (prob_sums / rows)).sum()
        ((h * g_all[rank].double()).sum() + aux).backward()
        torch.testing.assert_close(
            res["aux"].double(), aux.detach(), rtol=1e-5, atol=1e-6, msg=f"rank {rank}"
        )
    for i, p in enumerate(params):
        for name, ref in p.items():
            parts = [r["grads"][f"{i}.{name}"] for r in results]
            got = torch.cat(parts) if name.startswith("experts.") else sum(parts)
            torch.testing.assert_close(got.double(), ref.grad, rtol=1e-4, atol=1e-5, msg=f"{i}.{name}")


def _errors_worker() -> list[str]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    msgs = []
    for backend, num_experts, twice in (
        ("deepep", E, False),
        ("all_to_all", 3, False),
        ("all_to_all", E, True),
        ("nccl", E, False),
    ):
        layer = MoELayer(H, FFN, num_experts, RouterConfig(top_k=1))
        try:
            expert_parallel(layer, mesh, backend=backend)  # type: ignore[arg-type]
            if twice:
                expert_parallel(layer, mesh)
        except (ImportError, ValueError) as e:
            msgs.append(str(e))
            if not twice:  # a refused backend or size leaves the layer as it was
                assert not isinstance(layer.experts.gate_up_proj, DTensor)
                assert isinstance(layer.dispatcher, LocalDispatcher)
        else:
            msgs.append("no error")
    for backend, num_chunks in (("all_to_all", 0), ("deepep", 2), ("all_gather", 0)):
        layer = MoELayer(H, FFN, E, RouterConfig(top_k=1))
        with pytest.raises(ValueError) as info:
            expert_parallel(layer, mesh, backend=backend, num_chunks=num_chunks)  # type: ignore[arg-type]
        assert isinstance(layer.dispatcher, LocalDispatcher)
        msgs.append(str(info.value))
    return msgs


def test_expert_parallel_errors() -> None:
    try:
        import deep_ep  # noqa: F401
    except ImportError:
        has_deep_ep = False
    else:
        has_deep_ep = True
    deepep_msg, divisible_msg, twice_msg, backend_msg, chunks_msg, deepep_chunks_msg, gather_msg = (
        run_distributed(_errors_worker, 2)[0]
    )
    assert "num_chunks must be >= 1, got 0" in chunks_msg
    assert "num_chunks applies to backends 'all_to_all' and 'all_gather', not 'deepep'" in deepep_chunks_msg
    assert "AllGatherDispatcher: num_chunks must be >= 1, got 0" in gather_msg
    if not has_deep_ep:
        assert "plait-moe[deepep]" in deepep_msg
    assert "not divisible" in divisible_msg
    assert "already a DTensor" in twice_msg
    assert "backend must be 'all_to_all', 'all_gather' or 'deepep', got 'nccl'" in backend_msg


def _ep_outputs(
    seed: int,
    router_kwargs: dict[str, Any],
    backend: str,
    compiled: bool = False,
    buffer_factor: float | None = None,
) -> list[torch.Tensor]:
    """This rank's output, input gradient and local parameter gradients of an EP layer (capacity 0.75),
    eager or compiled with ``fullgraph=True`` (a graph break fails)."""
    from torch._dynamo.utils import counters

    rank, world = dist.get_rank(), dist.get_world_size()
    x_all, g_all = _inputs(world, seed, None)
    layer = _make_layer(seed, {"capacity_factor": 0.75}, router_kwargs, None)
    mesh = init_device_mesh("cpu", (world,))
    expert_parallel(layer, mesh, backend=backend, buffer_factor=buffer_factor)  # type: ignore[arg-type]
    counters.clear()
    torch._dynamo.reset()
    fn = torch.compile(layer, fullgraph=True, backend="aot_eager") if compiled else layer
    x = x_all[rank].clone().requires_grad_()
    out = fn(x)
    ((out.hidden_states * g_all[rank]).sum() + out.aux_loss).backward()
    assert not counters["graph_break"], dict(counters["graph_break"])
    grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in layer.parameters()]
    return [out.hidden_states.detach(), x.grad, *grads]


def _compiled_worker() -> list[float]:
    router = {"top_k": 3, "aux_loss_coef": 0.05}
    # A bounded expert buffer (54 of the exact 72 rows): its overflow assert and clamped groups trace too.
    eager, compiled = (_ep_outputs(13, router, "all_gather", c, buffer_factor=1.5) for c in (False, True))
    return [float((a - b).abs().max()) for a, b in zip(eager, compiled, strict=True)]


def test_all_gather_dispatch_compiles_fullgraph() -> None:
    """The EP layer is one graph for torch.compile (no break at the dispatch: the packed all-gather's
    autograd.Function, the bounded buffer's device-side assert) and equals eager."""
    for diffs in run_distributed(_compiled_worker, 2):
        assert max(diffs) <= 1e-6, diffs


def _unequal_tokens_worker() -> str:
    rank, world = dist.get_rank(), dist.get_world_size()
    layer = _make_layer(3, {}, {"top_k": 2}, None)
    expert_parallel(layer, init_device_mesh("cpu", (world,)), backend="all_gather")
    x, _ = _inputs(world, 3, None)
    with pytest.raises(RuntimeError) as info:
        layer(x[rank, : T - rank])  # rank 1 passes one token fewer
    return str(info.value)


def test_all_gather_dispatch_refuses_unequal_token_counts() -> None:
    for msg in run_distributed(_unequal_tokens_worker, 2):
        assert "every rank of the EP group must pass the same number of tokens" in msg


# --- all-gather dispatch: bounded expert buffer (buffer_factor), packed all-gather --------------------


def _routed_rows(
    world: int,
    seed: int,
    layer_kwargs: dict[str, Any],
    router_kwargs: dict[str, Any],
    one_hot_expert: int | None = None,
) -> list[int]:
    """Assignments each EP rank's experts get from every rank's tokens (the single-process routing)."""
    layer = _make_layer(seed, layer_kwargs, router_kwargs, one_hot_expert)
    local, seen = layer.dispatcher, []

    def spy(x: torch.Tensor, topk_idx: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        seen.append(topk_idx)
        return local(x, topk_idx, *args, **kwargs)

    layer.dispatcher = spy
    x_all, _ = _inputs(world, seed, one_hot_expert)
    with torch.no_grad():
        for rank in range(world):
            layer(x_all[rank])
    idx, n_local = torch.cat(seen), E // world
    return [int(((idx >= r * n_local) & (idx < (r + 1) * n_local)).sum()) for r in range(world)]


def _factor_for(rows: int, tokens: int, top_k: int) -> float:
    """The buffer_factor whose buffer is exactly ``rows`` rows (``ceil(f * tokens * top_k) == rows``)."""
    f = rows / (tokens * top_k)
    while math.ceil(f * tokens * top_k) > rows:
        f = math.nextafter(f, 0.0)
    while math.ceil(f * tokens * top_k) < rows:
        f = math.nextafter(f, math.inf)
    return f


@pytest.mark.parametrize("world", [2, 4])
def test_all_gather_bounded_buffer_matches_reference(world: int) -> None:
    """A buffer below the exact ``P*T*k`` bound that the fullest rank fills to its last row: the float64
    parity of the exact buffer (outputs, input and every parameter gradient)."""
    layer_kwargs = {"shared_expert_intermediate_size": 5}
    router_kwargs = {"top_k": 3, "norm_topk_prob": True, "aux_loss_coef": 0.05}
    need = max(_routed_rows(world, 12, layer_kwargs, router_kwargs))
    assert T * 3 < need < world * T * 3, need  # bounded, and above the balanced share
    factor = _factor_for(need, T, 3)
    _check(world, 12, layer_kwargs, router_kwargs, dispatch="all_gather", buffer_factor=factor)


def test_all_gather_bounded_buffer_chunked_with_capacity() -> None:
    """Chunks (each with its own bounded buffer) and dropped slots."""
    _check(
        2,
        seed=9,
        layer_kwargs={"shared_expert_intermediate_size": 5, "capacity_factor": 0.75},
        router_kwargs={"top_k": 3, "norm_topk_prob": True, "aux_loss_coef": 0.05},
        dispatch="all_gather",
        num_chunks=3,
        buffer_factor=1.75,
    )


def _overflow_worker(
    seed: int, factor: float, one_hot_expert: int | None, router_kwargs: dict[str, Any]
) -> str | None:
    rank, world = dist.get_rank(), dist.get_world_size()
    layer = _make_layer(seed, {}, router_kwargs, one_hot_expert)
    mesh = init_device_mesh("cpu", (world,))
    expert_parallel(layer, mesh, backend="all_gather", buffer_factor=factor)
    x, _ = _inputs(world, seed, one_hot_expert)
    try:
        layer(x[rank])
    except RuntimeError as e:
        # Only the overflowing rank stops (on CPU at once); the others wait in the output's
        # reduce-scatter: join it so that they finish (a real job's launcher tears them down).
        dummy = torch.zeros(world * T, H)
        dist.reduce_scatter_tensor(torch.empty(T, H), dummy, group=mesh.get_group())
        return str(e)
    return None


def test_all_gather_bounded_buffer_overflow_raises() -> None:
    """Every token on rank 1's expert 5 with factor 1.0: rank 1's experts get 2x their buffer. The step
    stops there with a message naming the option and the fix; rank 0 (no overflow) runs on."""
    msgs = run_distributed(_overflow_worker, 2, 3, 1.0, 5, {"top_k": 1})
    assert msgs[0] is None
    assert msgs[1] is not None
    assert "raise parallel.expert_buffer_factor (now 1)" in msgs[1], msgs[1]
    assert "expert buffer's 12 rows" in msgs[1] and "None (exact bound, 24 rows)" in msgs[1], msgs[1]


def test_all_gather_overflow_message_fits_cuda() -> None:
    """CUDA refuses ``_assert_async`` messages of 255 characters or more ("Message length must be
    smaller than 255"): the longest numbers still fit, the option's name included."""
    from plait.moe.dispatch.all_gather import _overflow_message

    msg = _overflow_message(2**62, 1 / 3 + 1e-12, 2**63 - 1)
    assert len(msg) < 255 and "parallel.expert_buffer_factor (now 0.333333)" in msg and "None" in msg


def test_all_gather_bounded_buffer_one_row_short_raises() -> None:
    """The tightest overflow: one row fewer than the fullest rank needs."""
    router_kwargs = {"top_k": 3}
    need = _routed_rows(2, 12, {}, router_kwargs)
    full = need.index(max(need))
    assert max(need) > T * 3
    msgs = run_distributed(_overflow_worker, 2, 12, _factor_for(max(need) - 1, T, 3), None, router_kwargs)
    assert msgs[1 - full] is None
    assert msgs[full] is not None and "parallel.expert_buffer_factor" in msgs[full]


def test_all_gather_buffer_factor_validation() -> None:
    for bad in (0.5, 0.0, -1.0, math.inf, math.nan, True, "2"):
        with pytest.raises(ValueError, match=r"buffer_factor \(parallel.expert_buffer_factor\) must be"):
            AllGatherDispatcher(None, buffer_factor=bad)  # type: ignore[arg-type]  # checked before the group


def _buffer_errors_worker() -> list[str]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    msgs = []
    for backend, factor in (("all_to_all", 1.5), ("deepep", 1.5), ("all_gather", 0.9)):
        layer = MoELayer(H, FFN, E, RouterConfig(top_k=1))
        with pytest.raises(ValueError) as info:
            expert_parallel(layer, mesh, backend=backend, buffer_factor=factor)  # type: ignore[arg-type]
        assert isinstance(layer.dispatcher, LocalDispatcher)  # refused: the layer is unchanged
        assert not isinstance(layer.experts.gate_up_proj, DTensor)
        msgs.append(str(info.value))
    layer = MoELayer(H, FFN, E, RouterConfig(top_k=2))
    expert_parallel(layer, mesh, backend="all_gather", buffer_factor=2)
    assert isinstance(layer.dispatcher, AllGatherDispatcher)
    # T=12, k=2 per rank: min(P*T*k, ceil(2 * T*k)); a 5-token chunk: ceil(2 * 10) = 20.
    assert layer.dispatcher.buffer_rows(T, 2, E // 2) == min(2 * T * 2, 48)
    assert layer.dispatcher.buffer_rows(5, 2, E // 2) == 20
    assert "buffer_factor=2.0" in repr(layer.dispatcher)
    return msgs


def test_expert_parallel_buffer_factor_errors() -> None:
    a2a, deepep, small = run_distributed(_buffer_errors_worker, 2)[0]
    assert "applies to backend 'all_gather' only, not 'all_to_all'" in a2a
    assert "parallel.expert_buffer_factor" in a2a
    assert "not 'deepep'" in deepep
    assert "must be a finite number >= 1 or None, got 0.9" in small


def _packed_gather_worker(dtype: torch.dtype, width: int) -> list[torch.Tensor]:
    """The packed all-gather (and its backward) against one functional collective per tensor."""
    from plait.moe.dispatch.all_gather import _PackedAllGather

    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    g = torch.Generator().manual_seed(rank)
    t, k = 5, 3
    x = torch.randn(t, width, generator=g).to(dtype).requires_grad_()
    w = torch.rand(t, k, generator=g).requires_grad_()  # fp32 routing weights
    ids = torch.randint(-1, 9, (t, k), generator=g, dtype=torch.int32)
    gx = torch.randn(world * t, width, generator=torch.Generator().manual_seed(10 + rank)).to(dtype)
    gw = torch.randn(world * t, k, generator=torch.Generator().manual_seed(20 + rank))
    xs, ws, idx = _PackedAllGather.apply(x, w, ids, group)
    assert (xs.dtype, ws.dtype, idx.dtype) == (dtype, torch.float32, torch.int32)
    assert not idx.requires_grad
    torch.autograd.backward([xs, ws], [gx, gw])
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    gather = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
    xs2, ws2, idx2 = gather(x2, 0, group), gather(w2, 0, group), gather(ids, 0, group)
    torch.autograd.backward([xs2, ws2], [gx, gw])
    out = [xs, xs2, ws, ws2, idx, idx2, x.grad, x2.grad, w.grad, w2.grad]
    return [t.detach().clone() for t in out]  # clone: waits for the (asynchronous) collectives


@pytest.mark.parametrize(("dtype", "width"), [(torch.bfloat16, 7), (torch.float32, 4), (torch.float64, 3)])
def test_packed_all_gather_equals_separate_gathers(dtype: torch.dtype, width: int) -> None:
    """Bitwise: tokens (bf16 with an odd width: padded rows), fp32 weights and int32 ids gathered in one
    collective, and the token and weight gradients reduce-scattered in their own dtypes."""
    for rank, res in enumerate(run_distributed(_packed_gather_worker, 2, dtype, width)):
        for i in range(0, len(res), 2):
            assert torch.equal(res[i], res[i + 1]), f"rank {rank}, item {i // 2}"


class _CollectiveCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the functional-collective ops (their waits left out) dispatched under it."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.name()
        op = name.split("::")[-1].removesuffix(".default")
        # The collectives; not their waits nor the eager async-tensor wrapper (_wrap_tensor_autograd).
        if name.startswith("_c10d_functional::") and not op.startswith(("wait_tensor", "_")):
            self.ops.append(op)
        return func(*args, **(kwargs or {}))


def _count_worker(num_chunks: int) -> tuple[list[str], list[str]]:
    rank, world = dist.get_rank(), dist.get_world_size()
    layer = _make_layer(3, {}, {"top_k": 2}, None)
    expert_parallel(layer, init_device_mesh("cpu", (world,)), backend="all_gather", num_chunks=num_chunks)
    x_all, g_all = _inputs(world, 3, None)
    x = x_all[rank].clone().requires_grad_()
    with _CollectiveCounter() as fwd:
        out = layer(x)
    with _CollectiveCounter() as bwd:
        (out.hidden_states * g_all[rank]).sum().backward()
    return fwd.ops, bwd.ops


@pytest.mark.parametrize("num_chunks", [1, 3])
def test_all_gather_dispatch_collective_count(num_chunks: int) -> None:
    """Per chunk: one packed all-gather and one reduce-scatter forward, one coalesced reduce-scatter and
    one all-gather backward; plus the token-count all-gather once per forward. (Before the packing:
    three all-gathers per chunk forward, two reduce-scatters and an all-gather per chunk backward.)"""
    fwd, bwd = run_distributed(_count_worker, 2, num_chunks)[0]
    n = num_chunks
    gather, scatter = "all_gather_into_tensor", "reduce_scatter_tensor"
    assert sorted(fwd) == sorted([gather] * (1 + n) + [scatter] * n), fwd
    assert sorted(bwd) == sorted([f"{scatter}_coalesced"] * n + [gather] * n), bwd
