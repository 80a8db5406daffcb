"""CUDA (compute capability 8.9+): FP8 training (``ParallelConfig.float8``) of a Llama-shaped model
tracks bf16 from the same init, its gradients stay within float8 error of bf16's, and the decoder
layers with float8 linears compile as one graph each."""

from __future__ import annotations

import pytest
import torch
from plait.models import CausalLMProvider, Float8Training, ParallelConfig
from plait.models.llama import LlamaConfig

pytest.importorskip("torchao.float8")

# Every linear's dimensions are multiples of 16: all 4 x 7 decoder-layer linears are converted.
CFG = LlamaConfig(
    vocab_size=1024, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=64,
)  # fmt: skip
STEPS, BATCH, SEQ = 20, 8, 257  # 256 inputs per row: float8 GEMMs need tokens divisible by 16


def _float8_gpu() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def _batches(device: str) -> list[torch.Tensor]:
    """A learnable stream: each token has 4 possible successors (a fixed random table), so the loss
    falls from ln(1024) ~ 6.9 towards ln(4) ~ 1.4."""
    g = torch.Generator().manual_seed(0)
    table = torch.randint(0, CFG.vocab_size, (CFG.vocab_size, 4), generator=g)
    out = []
    for _ in range(4):
        ids = torch.empty(BATCH, SEQ, dtype=torch.long)
        ids[:, 0] = torch.randint(0, CFG.vocab_size, (BATCH,), generator=g)
        for t in range(1, SEQ):
            ids[:, t] = table[ids[:, t - 1], torch.randint(0, 4, (BATCH,), generator=g)]
        out.append(ids.to(device))
    return out


def _stage(recipe: str | None, device: str, compile: bool = False):
    parallel = ParallelConfig(float8=Float8Training(recipe=recipe, emulate=device != "cuda"), compile=compile)
    provider = CausalLMProvider(CFG, parallel=parallel, dtype=torch.bfloat16, seed=0)
    stage = provider.parallelize(provider.build_stage(0, 1), None)
    provider.materialize(stage, device)
    return stage


def _train(recipe: str | None, device: str = "cuda") -> list[float]:
    model = _stage(recipe, device)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.0)
    losses = []
    batches = _batches(device)
    for step in range(STEPS):
        ids = batches[step % len(batches)]
        loss = model(input_ids=ids[:, :-1], labels=ids[:, 1:])["loss"]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@pytest.mark.gpu
@pytest.mark.skipif(not _float8_gpu(), reason="float8 GEMMs need compute capability 8.9+")
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_training_tracks_bf16(recipe):
    bf16, fp8 = _train(None), _train(recipe)
    # It learns (emulated on the CPU: 6.98 -> 6.55 over the last five steps), and float8 follows:
    # each step's loss within 3% of bf16's (at most 1.3% measured emulated), the last five steps'
    # mean within 2% (0.5%).
    assert sum(bf16[-5:]) / 5 < bf16[0] - 0.2, bf16
    for step, (a, b) in enumerate(zip(bf16, fp8, strict=True)):
        assert b == pytest.approx(a, rel=3e-2), (step, bf16, fp8)
    assert sum(fp8[-5:]) == pytest.approx(sum(bf16[-5:]), rel=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not _float8_gpu(), reason="float8 GEMMs need compute capability 8.9+")
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_gradients_within_float8_error_of_bf16(recipe):
    """First-step gradients of every decoder-layer linear against an fp32 model from the same
    init. Tolerances (relative Frobenius error, worst of the 28 weights): bf16 < 3%, float8 < 30%
    and cosine > 0.95 (e4m3 keeps 3 mantissa bits, e5m2 gradients 2). Emulated on the CPU: bf16
    1.3%; float8 18% / 0.984 (tensorwise), 16% / 0.987 (rowwise). A wrong scale gives ~100%."""
    ids = _batches("cuda")[0]
    grads = {}
    for name, recipe_ in (("fp32", None), ("bf16", None), ("fp8", recipe)):
        model = _stage(recipe_, "cuda")
        if name == "fp32":
            model.float()
        model(input_ids=ids[:, :-1], labels=ids[:, 1:])["loss"].backward()
        grads[name] = {n: p.grad.float() for n, p in model.named_parameters() if "proj" in n}
    assert len(grads["fp8"]) == 4 * 7
    for n, ref in grads["fp32"].items():
        err = {k: ((grads[k][n] - ref).norm() / ref.norm()).item() for k in ("bf16", "fp8")}
        cos = torch.nn.functional.cosine_similarity(grads["fp8"][n].flatten(), ref.flatten(), dim=0).item()
        assert err["bf16"] < 0.03, (n, err)
        assert err["fp8"] < 0.3 and cos > 0.95, (n, err, cos)


@pytest.mark.gpu
@pytest.mark.skipif(not _float8_gpu(), reason="float8 GEMMs need compute capability 8.9+")
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_layers_compile_fullgraph(recipe):
    """Each decoder layer with float8 linears compiles as one graph (``fullgraph=True`` raises on a
    break), forward and backward: the loss within 1% of eager float8's, and every linear's gradient as
    close to the fp32 model's as eager float8's is (within float8's bound, at most 5 points worse).

    Compiled and eager float8 round differently (fused amax and scale computation), so their gradients
    are compared through the fp32 reference, not with each other: two float8 runs each within ~15% of
    fp32 can be ~15% apart (measured on an H100, layer 0's q_proj: 10% rowwise, 16% tensorwise).
    """
    ids = _batches("cuda")[0]
    losses, grads = {}, {}
    for name in ("fp32", "eager", "compiled"):
        torch._dynamo.reset()
        model = _stage(None if name == "fp32" else recipe, "cuda")
        if name == "fp32":
            model.float()
        if name == "compiled":
            for layer in model.decoder_layers():
                layer.compile(fullgraph=True)
        loss = model(input_ids=ids[:, :-1], labels=ids[:, 1:])["loss"]
        loss.backward()
        losses[name] = loss.item()
        grads[name] = {n: p.grad.float() for n, p in model.named_parameters() if "proj" in n}
    assert losses["compiled"] == pytest.approx(losses["eager"], rel=1e-2)
    for n, ref in grads["fp32"].items():
        err = {k: ((grads[k][n] - ref).norm() / ref.norm()).item() for k in ("eager", "compiled")}
        cos = torch.nn.functional.cosine_similarity(grads["compiled"][n].flatten(), ref.flatten(), dim=0)
        assert err["compiled"] < 0.3 and cos.item() > 0.95, (n, err, cos.item())
        assert err["compiled"] < err["eager"] + 0.05, (n, err)


@pytest.mark.gpu
@pytest.mark.skipif(not _float8_gpu(), reason="float8 GEMMs need compute capability 8.9+")
@pytest.mark.parametrize("compiled", [False, True])
def test_fp8_experts_within_float8_error_of_fp32(compiled):
    """Routed experts with float8 grouped GEMMs (``Float8Training.experts``; uneven groups, one empty,
    none a multiple of 16) against the same experts in fp32: output and every gradient within
    float8's bound (relative Frobenius error < 15%, cosine > 0.99), while bf16 stays within 2%; the
    compiled experts trace as one graph."""
    from plait.models.common.parallel.float8 import float8_grouped_mm
    from plait.moe import GroupedExperts

    torch.manual_seed(0)
    counts = torch.tensor([700, 0, 1013, 333, 1500, 550], device="cuda")
    x = torch.randn(int(counts.sum()), 1024, device="cuda")
    rw = torch.rand(x.shape[0], device="cuda")
    dy = torch.randn_like(x)
    ref = GroupedExperts(6, 1024, 512).cuda()
    results = {}
    for name in ("fp32", "bf16", "fp8"):
        experts = GroupedExperts(6, 1024, 512).cuda()
        experts.load_state_dict(ref.state_dict())
        if name != "fp32":
            experts.bfloat16()
        if name == "fp8":
            experts.grouped_mm = float8_grouped_mm
        fwd = torch.compile(experts, fullgraph=True) if compiled and name == "fp8" else experts
        xi = x.detach().to(next(experts.parameters()).dtype, copy=True).requires_grad_()
        y = fwd(xi, counts, rw.to(xi.dtype))
        y.backward(dy.to(y.dtype))
        results[name] = [y.float(), xi.grad.float(), *(p.grad.float() for p in experts.parameters())]
    for name, bound, min_cos in (("bf16", 0.02, 0.999), ("fp8", 0.15, 0.99)):
        for i, (got, want) in enumerate(zip(results[name], results["fp32"], strict=True)):
            err = ((got - want).norm() / want.norm()).item()
            cos = torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0).item()
            assert err < bound and cos > min_cos, (name, i, err, cos)
