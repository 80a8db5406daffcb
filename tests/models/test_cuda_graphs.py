"""``ParallelConfig.cuda_graphs``: the compiled decoder layers replayed as CUDA graphs.

On the CPU: what the option refuses (no compile, a layout of several processes per stage, CPU
activations), and gradients that accumulate over microbatches whose backward reuses its output memory.
On a GPU (``gpu``): a few training steps with graphs, one or several microbatches each, equal the same
compiled steps without them, and the layers really ran as graph replays (no skipped capture, graph
launches seen, no graph recorded again).
"""

from __future__ import annotations

import pytest
import torch
from plait.dist_core import DeviceMeshParameters, DistributedContext
from plait.dist_core.testing import run_distributed
from plait.models import CausalLMProvider, ParallelConfig, config_from_hf
from pydantic import ValidationError
from torch.distributed.tensor import DTensor

MOE = {
    "model_type": "qwen3_moe",
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "moe_intermediate_size": 32,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "router_aux_loss_coef": 0.01,
}
LLAMA = {
    "model_type": "llama",
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 16,
}


def test_cuda_graphs_need_compile():
    with pytest.raises(ValidationError, match=r"parallel\.cuda_graphs needs parallel\.compile"):
        ParallelConfig(cuda_graphs=True)


def _cpu_model_with_graphs() -> torch.nn.Module:
    """The small Llama, its layers compiled for CUDA graphs, materialised on the CPU."""
    provider = CausalLMProvider(
        config_from_hf(LLAMA), parallel=ParallelConfig(compile=True, cuda_graphs=True)
    )
    model = provider.build_stage(0, 1)
    provider.parallelize(model, None)
    provider.materialize(model, "cpu")
    return model


def test_cuda_graphs_refuse_cpu_activations():
    model = _cpu_model_with_graphs()
    with pytest.raises(RuntimeError, match=r"parallel\.cuda_graphs needs CUDA activations, got cpu"):
        model(input_ids=torch.zeros(1, 8, dtype=torch.long))


class _PoolGrad(torch.autograd.Function):
    """``x * w`` whose backward hands out the weight gradient in one buffer, which its forward overwrites, as
    a CUDA-graph replay's output in the graph trees' pool is overwritten by the next forward's replays."""

    pool: torch.Tensor | None = None

    @staticmethod
    def forward(ctx, x, w):
        if _PoolGrad.pool is not None:
            _PoolGrad.pool.fill_(-1.0)  # the next forward's replays reuse the pool
        ctx.save_for_backward(x)
        return x * w

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        if _PoolGrad.pool is None:
            _PoolGrad.pool = torch.empty_like(x[0])
        _PoolGrad.pool.copy_((dy * x).sum(0))
        return None, _PoolGrad.pool.view(_PoolGrad.pool.shape)  # a new tensor on that memory, as a replay's


def _accumulate(w: torch.nn.Parameter, xs: list[torch.Tensor], read=None) -> torch.Tensor:
    """Two steps of ``len(xs)`` microbatches through :class:`_PoolGrad` on ``w``, each step from gradients
    set to None as ``zero_grad`` does, each forward after what the trunk's forward does first under graphs
    (:func:`own_pending_graph_gradients`): the last step's accumulated gradient (float64). ``read(w)`` runs
    after each step's backwards, where an optimizer step reads the gradients."""
    from plait.models.common.model import own_pending_graph_gradients

    _PoolGrad.pool = None
    for _ in range(2):
        w.grad = None
        for x in xs:
            own_pending_graph_gradients()
            _PoolGrad.apply(x, w).sum().backward()
        got = w.grad.double()
        if read is not None:
            read(w)
    return got


def test_gradients_accumulate_over_microbatches_whose_backward_reuses_its_output_memory():
    """Four microbatches accumulate into one gradient although each forward overwrites the memory the last
    backward wrote its gradient in (the graph trees' pool): equal to the float64 sum of the microbatches'
    gradients; without own_graph_gradients, autograd keeps that memory as ``.grad`` and the sum is wrong.
    With one microbatch per step no gradient is copied: the step reads it before the next forward."""
    from plait.models.common.model import own_graph_gradients

    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(3, 5, generator=gen) for _ in range(4)]
    expected = sum(x.double().sum(0) for x in xs)
    plain, owned = torch.nn.Module(), torch.nn.Module()  # each one parameter, standing for a layer's weight
    plain.w, owned.w = torch.nn.Parameter(torch.ones(5)), torch.nn.Parameter(torch.ones(5))
    own_graph_gradients([owned])
    own_graph_gradients([owned])  # a second call adds no second hook
    torch.testing.assert_close(_accumulate(owned.w, xs), expected)
    assert owned.w.grad.data_ptr() != _PoolGrad.pool.data_ptr()
    assert not torch.allclose(_accumulate(plain.w, xs), expected)
    assert plain.w.grad.data_ptr() == _PoolGrad.pool.data_ptr()  # autograd kept the pool's memory

    def in_pool(w):
        assert w.grad.data_ptr() == _PoolGrad.pool.data_ptr()  # read where the backward left it

    torch.testing.assert_close(_accumulate(owned.w, xs[:1], read=in_pool), xs[0].double().sum(0))


def _graph_trunk_on_cpu(monkeypatch: pytest.MonkeyPatch) -> torch.nn.Module:
    """The small MoE model whose trunk runs as under CUDA graphs (graph steps, hooks, static buffers) but
    uncompiled, on the CPU: the CUDA check is lifted, what the trunk does around each layer is tested."""
    from plait.models.common import model as model_module

    monkeypatch.setattr(model_module, "_check_graph_device", lambda h: None)
    provider = CausalLMProvider(config_from_hf(MOE))
    model = provider.build_stage(0, 1)
    provider.materialize(model, "cpu")
    model.model.cuda_graphs = True
    return model


def test_a_training_forward_under_cuda_graphs_owns_the_materialised_layers_gradients(monkeypatch):
    """The hooks go on the parameters a training forward finds, not on those ``parallelize`` saw: materialising
    the model built on meta replaced every parameter (and would have dropped hooks set before); the next
    forward copies a gradient the parameter still holds out of the pool. The layers'
    buffers (the routers' load counts, updated inside the layer) become static graph inputs."""
    model = _graph_trunk_on_cpu(monkeypatch)
    weight = model.model.layers["1"].self_attn.o_proj.weight
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(2, *weight.shape, generator=gen) for _ in range(4)]
    expected = sum(x.double().sum(0) for x in xs)
    ids = torch.zeros(1, 8, dtype=torch.long)
    with torch.no_grad():
        model(input_ids=ids)  # evaluation: no hook
    assert not torch.allclose(_accumulate(weight, xs), expected)
    model(input_ids=ids)
    torch.testing.assert_close(_accumulate(weight, xs), expected, rtol=1e-5, atol=1e-5)  # fp32 sums
    weight.grad = None
    _PoolGrad.apply(xs[0], weight).sum().backward()
    assert weight.grad.data_ptr() == _PoolGrad.pool.data_ptr()
    with torch.no_grad():
        model(input_ids=ids)  # any forward with graphs copies the held gradient before its replays
    assert weight.grad.data_ptr() != _PoolGrad.pool.data_ptr()
    torch.testing.assert_close(weight.grad, xs[0].sum(0))
    buffers = list(model.model.layers["0"].buffers())
    assert buffers and all(b._dynamo_static_input_type == "unguarded" for b in buffers)


def _fsdp_graph_layers_worker(reshard_after_forward: bool | None) -> dict[str, object]:
    """Two gloo ranks, FSDP over both, the plan of ``cuda_graphs`` (uncompiled: its FSDP part is tested)."""
    from plait.dist_core.fsdp_state import param_groups
    from plait.models.common import model as model_module
    from plait.models.common.model import _own_gradient

    ctx = DistributedContext.from_env(DeviceMeshParameters(data_shard=2), device="cpu")
    # compile off (CPU, CI): model_copy skips the check that graphs need it
    parallel = ParallelConfig().model_copy(
        update={"cuda_graphs": True, "reshard_after_forward": reshard_after_forward}
    )
    provider = CausalLMProvider(config_from_hf(MOE), parallel=parallel)
    model = provider.build_stage(0, 1)
    try:
        provider.parallelize(model, ctx)
    except ValueError as e:
        return {"error": str(e)}
    provider.materialize(model, "cpu")
    model.model.cuda_graphs = True
    layer = model.model.layers["0"]
    ids = torch.randint(0, MOE["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(ctx.rank))
    gathered = []
    check, model_module._check_graph_device = model_module._check_graph_device, lambda h: None  # CPU
    try:
        for _ in range(2):
            out = model(input_ids=ids[:, :-1], labels=ids[:, 1:])
            gathered.append([p for p in layer.parameters() if not isinstance(p, DTensor)])
            out["loss_sum"].backward()
    finally:
        model_module._check_graph_device = check
    unsharded = [p._unsharded_param for g in param_groups(layer) for p in g.fsdp_params]
    return {
        # what the layer held after its forward: its gathered parameters, the same tensors each step
        "gathered_after_forward": len(gathered[0]) == len(unsharded)
        and all(a is b for a, b in zip(gathered[0], gathered[1])),
        "hooked": all(_own_gradient in (p._post_accumulate_grad_hooks or {}).values() for p in unsharded),
        "kept": all(p.untyped_storage().size() > 0 for p in unsharded),  # resharded after backward
        "sharded_now": all(isinstance(p, DTensor) for p in layer.parameters()),
    }


def test_cuda_graphs_under_fsdp_keep_the_gathered_layers_at_fixed_addresses():
    """With FSDP the layers keep their gathered parameters from forward to backward (no resharding after
    forward), their memory stays allocated when they reshard after backward (every all-gather writes the
    same addresses: the graphs read them there), and a training forward hooks those gathered parameters."""
    for rank in run_distributed(_fsdp_graph_layers_worker, 2, None):
        assert rank == {"gathered_after_forward": True, "hooked": True, "kept": True, "sharded_now": True}
    for msg in run_distributed(_fsdp_graph_layers_worker, 2, True):
        assert "parallel.reshard_after_forward=true frees nothing under parallel.cuda_graphs" in msg["error"]


def _layout_worker(mesh: dict[str, int], expert_dispatch: str | None) -> str:
    """Apply the graphs' plan (compiled lazily: nothing runs) to the small MoE over two gloo ranks."""
    ctx = DistributedContext.from_env(DeviceMeshParameters(**mesh), device="cpu")
    parallel = ParallelConfig(compile=True, cuda_graphs=True, expert_dispatch=expert_dispatch)
    provider = CausalLMProvider(config_from_hf(MOE), parallel=parallel)
    try:
        provider.parallelize(provider.build_stage(0, 1), ctx)
    except ValueError as e:
        return str(e)
    return "no error"


def test_cuda_graphs_refuse_tensor_parallelism_and_host_synchronising_expert_dispatch():
    for msg in run_distributed(_layout_worker, 2, {"tensor": 2}, "all_to_all"):
        assert "parallel.cuda_graphs needs one stage per process and no collective inside a layer" in msg
        assert "mesh.tensor=2" in msg
    for msg in run_distributed(_layout_worker, 2, {"data_shard": 2, "expert": 2}, "all_to_all"):
        assert "parallel.expert_dispatch='all_gather'" in msg and "'all_to_all' synchronises" in msg
    # the all-gather dispatch keeps every size on the device: its graphs are allowed; it is the one an unset
    # parallel.expert_dispatch takes under graphs
    fsdp_ep = {"data_shard": 2, "expert": 2}
    for dispatch in ("all_gather", None):
        assert run_distributed(_layout_worker, 2, fsdp_ep, dispatch) == ["no error"] * 2


def _train(
    hf: dict,
    cuda_graphs: bool,
    microbatches: int,
    steps: int = 6,
    data_shard: int = 1,
    expert: int = 1,
    checkpointing: str = "none",
) -> tuple[list[float], dict[str, torch.Tensor], int, list[int], dict[str, torch.Tensor]]:
    """``steps`` AdamW steps of the bf16 model on two alternating packed batches with different documents
    (FlexAttention with document masks, as the main job on a GPU), each step's gradient accumulated over
    ``microbatches`` backwards: losses, final weights, the graph launches seen in the steps after the
    first three (the graph trees' warm-up and recording), the graph recordings seen in the first three
    steps and in the rest, and the initial weights. ``data_shard`` > 1: FSDP over that many ranks (run on
    each), each rank its own batches; ``expert`` > 1: the experts split over that many of them (the
    all-gather dispatch); ``checkpointing``: every decoder layer's activation checkpointing mode."""
    torch._dynamo.reset()
    parallel = ParallelConfig(
        compile=True,
        cuda_graphs=cuda_graphs,
        expert_dispatch="all_gather",
        activation_checkpointing={"mode": checkpointing},
    )
    provider = CausalLMProvider(config_from_hf(hf), parallel=parallel, dtype=torch.bfloat16, seed=0)
    model = provider.build_stage(0, 1)
    ctx = None
    if data_shard > 1:
        mesh = DeviceMeshParameters(data_shard=data_shard, expert=expert)
        ctx = DistributedContext.from_env(mesh, device="cuda")
    provider.parallelize(model, ctx)
    provider.materialize(model, "cuda")
    model.train()
    initial = _weights(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(ctx.rank if ctx is not None else 0)
    b, s = 2, 128  # FlexAttention's block size: shorter rows did not lower (fp32, 64 tokens)
    batches = [torch.randint(0, hf["vocab_size"], (b, s + 1), generator=gen).cuda() for _ in range(2)]
    # Two documents a row, split at 80 or 30 tokens: each forward builds new document ids and masks.
    positions = [torch.cat([torch.arange(n), torch.arange(s - n)]).expand(b, s).cuda() for n in (80, 30)]
    losses = []
    first, rest = (torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) for _ in range(2))
    first.start()
    for i in range(steps):
        if i == 3:
            first.stop()
            rest.start()
        total = 0.0
        for ids, pos in zip(batches[i % 2].chunk(microbatches), positions[i % 2].chunk(microbatches)):
            out = model(input_ids=ids[:, :-1], labels=ids[:, 1:], position_ids=pos)
            loss = out["loss_sum"] / (b * s) + out.get("aux_loss", 0.0) / microbatches
            loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
    rest.stop()
    launches = sum(e.count for e in rest.key_averages() if e.key == "cudaGraphLaunch")
    records = [
        sum(e.count for e in w.key_averages() if e.key.startswith("CUDAGraphNode.record"))
        for w in (first, rest)
    ]
    return losses, _weights(model), launches, records, initial


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in model.named_parameters()
    }


def _graphs_and_compiled(hf: dict, **kw: int | str) -> dict[str, object]:
    """``_train`` with graphs and without them."""
    from torch._dynamo.utils import counters

    ref_losses, ref_weights, ref_launches, _, initial = _train(hf, cuda_graphs=False, **kw)
    counters.clear()
    losses, weights, launches, records, _ = _train(hf, cuda_graphs=True, **kw)
    return {
        "skips": counters["inductor"]["cudagraph_skips"], "launches": (launches, ref_launches),
        "records": records, "losses": (losses, ref_losses), "weights": (weights, ref_weights, initial),
    }  # fmt: skip


def _check_trains_as_compiled(run: dict) -> None:
    """The graphs replayed and trained as the compiled layers do.

    The weights: each moved as without graphs, the two within a fifth of the distance it moved (plus bf16's
    rounding, 2**-8 of its norm). Not equal up to bf16: the compiled training without graphs differs from
    itself between runs (the small Qwen3-MoE's by up to 1.5% of a weight's norm after 6 steps, in hundreds
    of elements beyond bf16's tolerance; a router's top-k choice that flips sends tokens to other experts),
    while the graphs' runs repeated bit for bit (H200, 2026-12-02). A weight whose gradients a graph lost
    would be off by all of its move."""
    assert run["skips"] == 0  # no layer fell back to plain launches
    launches, ref_launches = run["launches"]
    assert ref_launches == 0 and launches > 0
    # New masks each forward, at the addresses of the last ones: the graphs replay, none records again
    # (the first steps' recordings show that the profile sees them).
    assert run["records"][0] > 0 and run["records"][1] == 0
    losses, ref_losses = run["losses"]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-3, atol=1e-4)
    weights, ref, initial = run["weights"]
    worst = 0.0
    for name, w in weights.items():
        r = ref[name].float()
        off, moved = (w.float() - r).norm().item(), (r - initial[name].float()).norm().item()
        worst = max(worst, off / moved if moved else 0.0)  # a norm's weights near 1 round 1e-3 steps away
        assert off <= moved / 5 + 2**-8 * r.norm().item(), (
            f"{name}: {off:.3g} from the compiled run's, which moved {moved:.3g}"
        )
    print(f"largest distance from the compiled run's weights over their move: {worst:.3f}")


@pytest.mark.gpu
@pytest.mark.parametrize("microbatches", [1, 2], ids=["one_backward", "accumulated"])
@pytest.mark.parametrize("hf", [MOE, LLAMA], ids=["qwen3_moe", "llama"])
def test_cuda_graph_training_equals_compiled_training(hf, microbatches):
    _check_trains_as_compiled(_graphs_and_compiled(hf, microbatches=microbatches))


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["selective", "full"])
def test_cuda_graph_training_of_checkpointed_layers_equals_compiled_training(mode):
    """Each decoder layer checkpointed (its recomputation inside the compiled layer's backward graph), as a
    user of ``gpu1.toml`` who turns checkpointing on runs it: the graphs replay and train as without them."""
    _check_trains_as_compiled(_graphs_and_compiled(MOE, microbatches=2, checkpointing=mode))


def _fsdp_pair(hf: dict, microbatches: int, expert: int) -> dict[str, object]:
    """On each of two ranks: FSDP (and EP) training with graphs and without them."""
    return _graphs_and_compiled(hf, microbatches=microbatches, data_shard=2, expert=expert)


@pytest.mark.multigpu
@pytest.mark.parametrize("expert", [1, 2], ids=["fsdp", "ep_x_fsdp"])
@pytest.mark.parametrize("microbatches", [1, 2], ids=["one_backward", "accumulated"])
def test_cuda_graph_training_under_fsdp_equals_compiled_fsdp_training(microbatches, expert):
    """Two GPUs, FSDP over both (each rank its own batches), the experts local or split over both (the
    all-gather dispatch's collectives then run inside the graphs): the layers keep their gathered
    parameters at fixed addresses, replay as graphs without recording again, and train as the compiled
    layers do."""
    for rank in run_distributed(_fsdp_pair, 2, MOE, microbatches, expert, backend="nccl", timeout=600):
        _check_trains_as_compiled(rank)
