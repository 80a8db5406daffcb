"""``ParallelConfig.cuda_graphs``: the compiled decoder layers replayed as CUDA graphs.

On the CPU: what the option refuses (no compile, a layout of several processes per stage, CPU
activations, a training forward that finds gradients kept from an earlier backward). On a GPU
(``gpu``): a few training steps with graphs equal the same compiled steps without them, and the layers
really ran as graph replays (no skipped capture, graph launches seen, no graph recorded again).
"""

from __future__ import annotations

import pytest
import torch
from plait.dist_core.testing import run_distributed
from plait.models import CausalLMProvider, ParallelConfig, config_from_hf
from plait.models.common.parallel.plan import parallelize_decoder
from pydantic import ValidationError
from torch.distributed.device_mesh import init_device_mesh

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


def test_cuda_graphs_refuse_gradients_kept_from_an_earlier_backward():
    """Accumulating over backwards would read gradients the graph trees overwrote: the forward refuses."""
    model = _cpu_model_with_graphs()
    ids = torch.zeros(1, 8, dtype=torch.long)
    weight = model.model.layers["1"].mlp.down_proj.weight
    weight.grad = torch.zeros_like(weight)
    with pytest.raises(RuntimeError, match=r"layers\.1\.mlp\.down_proj\.weight still has a gradient"):
        model(input_ids=ids)
    with (
        torch.no_grad(),
        pytest.raises(RuntimeError, match=r"needs CUDA activations"),
    ):  # evaluation is allowed
        model(input_ids=ids)
    model.model.embed_tokens.weight.grad = torch.zeros_like(model.model.embed_tokens.weight)
    weight.grad = None  # outside the layers' graphs, a gradient may accumulate
    with pytest.raises(RuntimeError, match=r"needs CUDA activations"):
        model(input_ids=ids)


def _tensor_parallel_worker() -> str:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    provider = CausalLMProvider(
        config_from_hf(LLAMA), parallel=ParallelConfig(compile=True, cuda_graphs=True)
    )
    try:
        parallelize_decoder(provider.build_stage(0, 1), dense_mesh=mesh, config=provider.parallel)
    except ValueError as e:
        return str(e)
    return "no error"


def test_cuda_graphs_refuse_tensor_parallelism():
    for msg in run_distributed(_tensor_parallel_worker, 2):
        assert "parallel.cuda_graphs needs one process per stage" in msg
        assert "mesh.tensor=2" in msg


def _train(
    hf: dict, cuda_graphs: bool, steps: int = 6
) -> tuple[list[float], dict[str, torch.Tensor], int, list[int]]:
    """``steps`` AdamW steps of the bf16 model on two alternating packed batches with different documents
    (FlexAttention with document masks, as the main job on a GPU): losses, final weights, the graph
    launches seen in the steps after the first three (the graph trees' warm-up and recording), and the
    graph recordings seen in the first three steps and in the rest."""
    torch._dynamo.reset()
    parallel = ParallelConfig(compile=True, cuda_graphs=cuda_graphs)
    provider = CausalLMProvider(config_from_hf(hf), parallel=parallel, dtype=torch.bfloat16, seed=0)
    model = provider.build_stage(0, 1)
    provider.parallelize(model, None)
    provider.materialize(model, "cuda")
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
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
        ids = batches[i % 2]
        out = model(input_ids=ids[:, :-1], labels=ids[:, 1:], position_ids=positions[i % 2])
        loss = out["loss_sum"] / ids[:, 1:].numel() + out.get("aux_loss", 0.0)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    rest.stop()
    launches = sum(e.count for e in rest.key_averages() if e.key == "cudaGraphLaunch")
    records = [
        sum(e.count for e in w.key_averages() if e.key.startswith("CUDAGraphNode.record"))
        for w in (first, rest)
    ]
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, launches, records


@pytest.mark.gpu
@pytest.mark.parametrize("hf", [MOE, LLAMA], ids=["qwen3_moe", "llama"])
def test_cuda_graph_training_equals_compiled_training(hf):
    from torch._dynamo.utils import counters

    ref_losses, ref_weights, ref_launches, _ = _train(hf, cuda_graphs=False)
    counters.clear()
    losses, weights, launches, records = _train(hf, cuda_graphs=True)
    assert counters["inductor"]["cudagraph_skips"] == 0  # no layer fell back to plain launches
    assert ref_launches == 0
    assert launches > 0
    # New masks each forward, at the addresses of the last ones: the graphs replay, none records again
    # (the first steps' recordings show that the profile sees them).
    assert records[0] > 0 and records[1] == 0
    # The same compiled kernels, replayed: equal up to bf16 rounding of the updates.
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-3, atol=1e-4)
    for name, w in weights.items():
        torch.testing.assert_close(w, ref_weights[name], msg=name)
