"""A Qwen3-MoE decoder layer compiles as one graph (``fullgraph=True``) and matches eager.

Every plait kernel the layer runs (RMSNorm with residual, the fused-probability SwiGLU, permute /
unpermute, grouped GEMM, the router's counters) is a torch custom op, so Dynamo traces the layer,
forward and backward, without a graph break. The pipeline's split backward (inputs pass, then
weights pass; through a compiled layer the inputs pass is the whole backward) equals a full backward.
"""

from __future__ import annotations

import copy

import pytest
import torch
from plait.models.common.attention import build_attention_mask
from plait.models.common.rope import RotaryEmbedding
from plait.models.gpt_oss import GptOssConfig, gpt_oss_layer
from plait.models.llama import LlamaConfig, llama_layer
from plait.models.qwen3 import Qwen3MoeConfig, qwen3_layer
from plait.pipelining import backward_input, backward_weight
from torch._dynamo.utils import counters


def _setup(device: str, dtype: torch.dtype, attn: str):
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        router_aux_loss_coef=0.01,
        attn_implementation=attn,
    )
    layer = qwen3_layer(cfg, 0).to(device=device, dtype=dtype).train()
    b, s = 2, 128
    # Packed rows: row 0 holds three documents, row 1 one.
    docs = torch.tensor([[0] * 40 + [1] * 50 + [2] * 38, [0] * s], device=device)
    pos = torch.arange(s, device=device).expand(b, s)
    rope = RotaryEmbedding(cfg.rope_parameters, cfg.resolved_head_dim, 512)(pos, dtype)
    mask = build_attention_mask(b, s, torch.device(device), dtype, document_ids=docs, implementation=attn)
    x = torch.randn(b, s, cfg.hidden_size, device=device, dtype=dtype)
    g = torch.randn_like(x)
    return layer, x, g, rope, mask


def _roots(h, aux, stats, g):
    """The layer's differentiable outputs and their incoming gradients (the pooled Switch-loss
    statistics get a fixed, non-uniform gradient so that their backward is checked too)."""
    roots, grads = [h], [g]
    if (
        aux is not None and aux.requires_grad
    ):  # with the default pooling over all layers the layer's own aux loss is a constant 0
        roots.append(aux)
        grads.append(torch.ones_like(aux))
    if stats is not None and stats.requires_grad:
        roots.append(stats)
        grads.append(torch.linspace(0.5, 1.5, stats.numel(), device=stats.device).reshape(stats.shape))
    return roots, grads


def _grads(fn, layer, x, g, rope, mask):
    """Forward (``fn``, the layer or its compiled version) + full backward: (output, aux, dx, grads)."""
    layer.zero_grad()
    xx = x.clone().requires_grad_()
    h, aux, stats = fn(xx, rope, mask)
    torch.autograd.backward(*_roots(h, aux, stats, g))
    aux = None if aux is None else aux.detach()
    return h.detach(), aux, xx.grad, {n: p.grad.clone() for n, p in layer.named_parameters()}


def _close(a: torch.Tensor, b: torch.Tensor, tol: dict, name: str) -> None:
    """``a`` equals ``b`` elementwise within ``tol`` (atol/rtol), or with ``{"rel_norm": r}`` within ``r`` in
    relative Frobenius norm (bf16: a weight gradient sums many rounded products, so single elements near
    zero differ by more than any elementwise rtol while the whole gradient agrees)."""
    a, b = a.double(), b.double()
    if "rel_norm" in tol:
        err = float((a - b).norm() / b.norm().clamp_min(1e-30))
        assert err <= tol["rel_norm"], f"{name}: relative norm error {err:.3e} > {tol['rel_norm']}"
    else:
        torch.testing.assert_close(a, b, **tol, msg=lambda m: f"{name}: {m}")


def _check_compiled(
    device: str, dtype: torch.dtype, attn: str, backend: str, tol: dict, vs_eager: bool
) -> None:
    """Compile with ``fullgraph=True`` (a graph break is an error), run forward + backward.

    ``vs_eager``: the compiled layer equals the eager one. Otherwise (bf16 under Inductor, whose fused
    rounding can flip a near-tied top-k choice of the router) only the split backward is checked,
    against the compiled layer's own full backward.
    """
    # Compiled without donated buffers, as plait.loop does for split-backward schedules, whose eager parts
    # keep the graph from the inputs pass to the weights pass (the config is read when the backward graph
    # compiles, at the first backward).
    with torch._functorch.config.patch(donated_buffer=False):
        _check_compiled_body(device, dtype, attn, backend, tol, vs_eager)


def _check_compiled_body(
    device: str, dtype: torch.dtype, attn: str, backend: str, tol: dict, vs_eager: bool
) -> None:
    layer, x, g, rope, mask = _setup(device, dtype, attn)
    compiled_layer = copy.deepcopy(layer)
    counters.clear()
    torch._dynamo.reset()
    compiled = torch.compile(compiled_layer, fullgraph=True, backend=backend)
    got = _grads(compiled, compiled_layer, x, g, rope, mask)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert all(bool(torch.isfinite(t).all()) for t in (*got[:3], *got[3].values()))
    ref = got
    if vs_eager:
        ref = _grads(layer, layer, x, g, rope, mask)
        for name, a, b in zip(("hidden", "aux_loss", "dx"), got[:3], ref[:3]):
            _close(a, b, tol, name)
        for name, grad in ref[3].items():
            _close(got[3][name], grad, tol, name)
        # The router's load counters advanced once per training forward, in both.
        assert torch.equal(compiled_layer.mlp.router._stat_counts, layer.mlp.router._stat_counts)
    assert int(compiled_layer.mlp.router._stat_counts.sum()) == x.shape[0] * x.shape[1] * 2

    # Split backward through the compiled layer: inputs pass, then weights pass, equals the full one.
    params = list(compiled_layer.parameters())
    compiled_layer.zero_grad()
    xx = x.clone().requires_grad_()
    h, aux, stats = compiled(xx, rope, mask)
    (dx,), work = backward_input(*_roots(h, aux, stats, g), [xx], params)
    assert all(p.grad is None for p in params)
    backward_weight(work)
    _close(dx, ref[2], tol, "split dx")
    for name, p in compiled_layer.named_parameters():
        _close(p.grad, ref[3][name], tol, f"split {name}")


def test_moe_decoder_layer_compiles_fullgraph_on_cpu() -> None:
    # Reference (PyTorch) kernel paths; aot_eager runs Dynamo and AOTAutograd (forward and backward
    # graphs, fake tensors) without Inductor's C++ build, which would dominate the test's time.
    _check_compiled("cpu", torch.float32, "sdpa", "aot_eager", {"atol": 1e-5, "rtol": 1e-4}, vs_eager=True)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_document_mask_inside_compiled_layer_on_cpu() -> None:
    # FlexAttention has no CPU backward: forward only here (the gpu test runs both directions).
    layer, x, _g, rope, mask = _setup("cpu", torch.float32, "flex")
    counters.clear()
    torch._dynamo.reset()
    compiled = torch.compile(copy.deepcopy(layer), fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        ref, got = layer(x, rope, mask), compiled(x, rope, mask)
    assert not counters["graph_break"], dict(counters["graph_break"])
    for a, b in zip(got, ref, strict=True):
        if a is None or b is None:
            assert a is b
            continue
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    # The document mask is honoured: changing a later document leaves an earlier one unchanged.
    x2 = x.clone()
    x2[0, 40:] += 1.0
    with torch.no_grad():
        out2 = compiled(x2, rope, mask)[0]
    torch.testing.assert_close(out2[0, :40], got[0][0, :40], atol=1e-6, rtol=1e-6)
    assert not torch.allclose(out2[0, 40:90], got[0][0, 40:90])


@pytest.mark.gpu
@pytest.mark.parametrize("attn", ["sdpa", "flex"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_decoder_layer_compiles_fullgraph_on_cuda(attn: str, dtype: torch.dtype) -> None:
    # Triton kernels, torch._grouped_mm (bf16), FlexAttention's document mask: one Inductor graph.
    if dtype == torch.float32:
        _check_compiled("cuda", dtype, attn, "inductor", {"atol": 1e-4, "rtol": 1e-3}, vs_eager=True)
    else:
        _check_compiled("cuda", dtype, attn, "inductor", {"atol": 2e-2, "rtol": 2e-2}, vs_eager=False)
        if attn == "sdpa":
            # bf16 numerics against eager: the same graph without Inductor's fusions (with flex the
            # eager HOP differs from the eager path's compiled kernel, which can flip a routing tie).
            # Inside a compiled graph RMSNorm and SwiGLU trace their PyTorch formulation, so eager runs
            # it too here (the fp32 case above compares them with eager's Triton kernels).
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv("PLAIT_KERNELS_DISABLE_TRITON", "1")
                _check_compiled("cuda", dtype, attn, "aot_eager", {"rel_norm": 2e-2}, vs_eager=True)


def _family_setup(family: str, device: str, dtype: torch.dtype, attn: str):
    """A decoder layer of ``family`` (Llama with biases; gpt-oss's sliding-window layer 0 with sinks
    and biased clamped-SwiGLU experts) on packed rows, with the mask its attention takes."""
    torch.manual_seed(0)
    common = dict(
        vocab_size=64,
        hidden_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        attn_implementation=attn,
    )
    if family == "llama":
        cfg = LlamaConfig(**common, intermediate_size=128, attention_bias=True, mlp_bias=True)
        layer = llama_layer(cfg, 0)
    else:
        cfg = GptOssConfig(
            **common,
            intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            sliding_window=24,
            router_aux_loss_coef=0.01,
            router_aux_loss_pooling="per_layer",
        )
        layer = gpt_oss_layer(cfg, 0)
    layer.reset_parameters(0.1)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if "sinks" in name or "bias" in name:
                p.copy_(torch.randn_like(p) * 0.5)
    layer = layer.to(device=device, dtype=dtype).train()
    b, s = 2, 128
    docs = torch.tensor([[0] * 40 + [1] * 50 + [2] * 38, [0] * s], device=device)
    pos = torch.arange(s, device=device).expand(b, s)
    rope = RotaryEmbedding(cfg.rope_parameters, cfg.resolved_head_dim, 512)(pos, dtype)
    mask = build_attention_mask(
        b,
        s,
        torch.device(device),
        dtype,
        document_ids=docs,
        implementation=attn,
        sliding_window=layer.sliding_window,
        sinks=layer.has_sinks,
    )
    x = torch.randn(b, s, cfg.hidden_size, device=device, dtype=dtype)
    return layer, x, torch.randn_like(x), rope, mask


def _check_family_compiled(
    family: str, device: str, dtype: torch.dtype, attn: str, backend: str, tol: dict, vs_eager: bool
) -> None:
    """:func:`_check_compiled` for a decoder layer of ``family``: fullgraph compile, forward and
    backward equal eager's (``vs_eager``), the split backward equals the full one."""
    with torch._functorch.config.patch(donated_buffer=False):
        layer, x, g, rope, mask = _family_setup(family, device, dtype, attn)
        assert (layer.sliding_window, layer.has_sinks) == (
            (24, True) if family == "gpt_oss" else (None, False)
        )
        compiled_layer = copy.deepcopy(layer)
        counters.clear()
        torch._dynamo.reset()
        compiled = torch.compile(compiled_layer, fullgraph=True, backend=backend)
        got = _grads(compiled, compiled_layer, x, g, rope, mask)
        assert not counters["graph_break"], dict(counters["graph_break"])
        assert (got[1] is None) == (family == "llama")
        assert all(bool(torch.isfinite(t).all()) for t in (got[0], got[2], *got[3].values()))
        ref = got
        if vs_eager:
            ref = _grads(layer, layer, x, g, rope, mask)
            for name, a, b in zip(("hidden", "aux_loss", "dx"), got[:3], ref[:3]):
                if b is not None:
                    _close(a, b, tol, name)
            assert set(got[3]) == set(ref[3])
            for name, grad in ref[3].items():
                _close(got[3][name], grad, tol, name)
        params = list(compiled_layer.parameters())
        compiled_layer.zero_grad()
        xx = x.clone().requires_grad_()
        h, aux, stats = compiled(xx, rope, mask)
        (dx,), work = backward_input(*_roots(h, aux, stats, g), [xx], params)
        assert all(p.grad is None for p in params)
        backward_weight(work)
        _close(dx, ref[2], tol, "split dx")
        for name, p in compiled_layer.named_parameters():
            _close(p.grad, ref[3][name], tol, f"split {name}")


@pytest.mark.parametrize("family", ["llama", "gpt_oss"])
def test_family_decoder_layer_compiles_fullgraph_on_cpu(family: str) -> None:
    # gpt-oss: the window and the sinks (the PyTorch sink reference on CPU) inside the graph.
    _check_family_compiled(
        family, "cpu", torch.float32, "sdpa", "aot_eager", {"atol": 1e-5, "rtol": 1e-4}, vs_eager=True
    )


@pytest.mark.gpu
@pytest.mark.parametrize("attn", ["sdpa", "flex"])
@pytest.mark.parametrize("family", ["llama", "gpt_oss"])
def test_family_decoder_layer_compiles_fullgraph_on_cuda_bf16(family: str, attn: str) -> None:
    # bf16 under Inductor (FlexAttention's window, document and sink path with attn="flex"): the split
    # backward against the compiled layer's own (a routing tie may flip against eager); then bf16
    # numerics against eager through the same graph without Inductor's fusions (sdpa, as above).
    _check_family_compiled(
        family, "cuda", torch.bfloat16, attn, "inductor", {"atol": 2e-2, "rtol": 2e-2}, vs_eager=False
    )
    if attn == "sdpa":
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("PLAIT_KERNELS_DISABLE_TRITON", "1")
            _check_family_compiled(
                family, "cuda", torch.bfloat16, attn, "aot_eager", {"rel_norm": 2e-2}, vs_eager=True
            )


def test_compiled_layer_under_checkpointing_counts_each_forward_once() -> None:
    # The recomputation in backward replays the compiled graph; the router's counting op checks for
    # it when it runs, so the load statistics see the microbatch once.
    layer, x, g, rope, mask = _setup("cpu", torch.float32, "sdpa")
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    xx = x.clone().requires_grad_()
    h, aux, stats = torch.utils.checkpoint.checkpoint(compiled, xx, rope, mask, use_reentrant=False)
    torch.autograd.backward(*_roots(h, aux, stats, g))
    assert int(layer.mlp.router._stat_counts.sum()) == x.shape[0] * x.shape[1] * 2
    assert int(layer.mlp.router._bias_counts.sum()) == x.shape[0] * x.shape[1] * 2


def _ep_all_gather_layer_worker() -> list[list[torch.Tensor]]:
    import torch.distributed as dist
    from plait.moe import expert_parallel
    from torch.distributed.device_mesh import init_device_mesh

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    results = []
    for compiled in (False, True):
        layer, x, g, rope, mask = _setup("cpu", torch.float32, "sdpa")
        x, g = x + rank, g * (rank + 1)  # each rank its own tokens
        expert_parallel(layer.mlp, mesh, backend="all_gather")
        counters.clear()
        torch._dynamo.reset()
        fn = torch.compile(layer, fullgraph=True, backend="aot_eager") if compiled else layer
        h, aux, dx, grads = _grads(fn, layer, x, g, rope, mask)
        assert not counters["graph_break"], dict(counters["graph_break"])
        results.append(
            [h, aux, dx, *(gr.to_local() if hasattr(gr, "to_local") else gr for gr in grads.values())]
        )
    return results


def test_expert_parallel_layer_compiles_fullgraph_with_all_gather_dispatch() -> None:
    # EP=2 on gloo: the all-gather dispatch keeps every size on the device, so the whole decoder layer,
    # its collectives included, is one graph, forward and backward, and equals eager.
    from plait.dist_core.testing import run_distributed

    for eager, compiled in run_distributed(_ep_all_gather_layer_worker, 2):
        for i, (a, b) in enumerate(zip(compiled, eager, strict=True)):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=lambda m, i=i: f"output {i}: {m}")
