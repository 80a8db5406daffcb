"""FP8 training (``ParallelConfig.float8``, torchao float8): which linears each family converts, the
errors, and the emulated float8 numerics against a float8 quantisation written out here (CPU)."""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch
from plait.models import CausalLMProvider, Float8Training, ParallelConfig, build_causal_lm, parallelize
from plait.models.common.parallel import apply_float8, check_float8, float8_linears
from plait.models.common.parallel.float8 import aligned_rows, float8_grouped_mm
from plait.models.deepseek_v3 import DeepseekV3Config
from plait.models.gpt_oss import GptOssConfig
from plait.models.llama import LlamaConfig
from plait.models.qwen3 import Qwen3MoeConfig
from plait.moe import GroupedExperts
from pydantic import ValidationError
from torch import nn

pytest.importorskip("torchao.float8")
from torchao.float8 import Float8LinearConfig, convert_to_float8_training
from torchao.float8.float8_linear import Float8Linear

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
ATTN_DIMS = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=64)

# family -> (config, converted, skipped); every attention projection is 32 -> 32 or 32 -> 16.
FAMILIES = {
    # the SwiGLU width 40 is not a multiple of 16: the MLPs stay in high precision
    "llama": (
        LlamaConfig(**ATTN_DIMS, intermediate_size=40, num_hidden_layers=2),
        [f"model.layers.{i}.self_attn.{p}" for i in range(2) for p in ATTN],
        [f"model.layers.{i}.mlp.{p}" for i in range(2) for p in MLP],
    ),
    # layer 1 dense (width 48); layers 0 and 2 MoE: router and grouped experts are not converted
    "qwen3_moe": (
        Qwen3MoeConfig(
            **ATTN_DIMS,
            intermediate_size=48,
            moe_intermediate_size=16,
            num_hidden_layers=3,
            num_experts=4,
            num_experts_per_tok=2,
            mlp_only_layers=(1,),
        ),
        [f"model.layers.{i}.self_attn.{p}" for i in range(3) for p in ATTN]
        + [f"model.layers.1.mlp.{p}" for p in MLP],
        [],
    ),
    # every layer MoE, attention with biases
    "gpt_oss": (
        GptOssConfig(
            **ATTN_DIMS,
            intermediate_size=16,
            num_hidden_layers=2,
            num_experts=4,
            num_experts_per_tok=2,
            sliding_window=4,
        ),
        [f"model.layers.{i}.self_attn.{p}" for i in range(2) for p in ATTN],
        [],
    ),
    # MLA: q_lora_rank 24 and kv_lora_rank + rope dim 16 + 8 = 24 are not multiples of 16; a dense
    # first layer (width 48), then a MoE layer whose shared expert (width 16) is converted
    "deepseek_v3": (
        DeepseekV3Config(
            hidden_size=32,
            num_attention_heads=4,
            num_key_value_heads=4,
            vocab_size=64,
            intermediate_size=48,
            moe_intermediate_size=16,
            num_hidden_layers=2,
            kv_lora_rank=16,
            q_lora_rank=24,
            qk_nope_head_dim=8,
            qk_rope_head_dim=8,
            v_head_dim=8,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            n_shared_experts=1,
            first_k_dense_replace=1,
        ),
        [f"model.layers.{i}.self_attn.{p}" for i in range(2) for p in ("kv_b_proj", "o_proj")]
        + [f"model.layers.0.mlp.{p}" for p in MLP]
        + [f"model.layers.1.mlp.shared_expert.{p}" for p in MLP],
        [
            f"model.layers.{i}.self_attn.{p}"
            for i in range(2)
            for p in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa")
        ],
    ),
}

EMULATED = {"recipe": "rowwise", "emulate": True}


def _meta(family: str) -> nn.Module:
    with torch.device("meta"):
        return build_causal_lm(FAMILIES[family][0])


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_conversion_picks_the_expected_linears(family):
    _, converted, skipped = FAMILIES[family]
    model = _meta(family)
    plan = float8_linears(model)
    assert sorted(plan.converted) == sorted(converted)
    assert sorted(name for name, _ in plan.skipped) == sorted(skipped)
    assert all("not multiples of 16" in why for _, why in plan.skipped)
    parallelize(model, config=ParallelConfig(float8=Float8Training(**EMULATED)))
    now = sorted(name for name, m in model.named_modules() if isinstance(m, Float8Linear))
    assert now == sorted(converted)
    assert type(model.lm_head) is not Float8Linear and type(model.model.embed_tokens) is not Float8Linear
    # parameter names (checkpoints, mappers) are unchanged
    assert sorted(n for n, _ in model.named_parameters()) == sorted(
        n for n, _ in _meta(family).named_parameters()
    )


def test_skip_keeps_named_linears_and_skipped_ones_are_reported(caplog):
    model = _meta("llama")
    with caplog.at_level("WARNING"):
        plan = apply_float8(model, Float8Training(**EMULATED, skip=("k_proj", "layers.1.")))
    assert sorted(plan.converted) == [f"model.layers.0.self_attn.{p}" for p in ("o_proj", "q_proj", "v_proj")]
    reasons = dict(plan.skipped)
    assert reasons["model.layers.0.self_attn.k_proj"] == "matches parallel.float8.skip 'k_proj'"
    assert reasons["model.layers.1.self_attn.q_proj"] == "matches parallel.float8.skip 'layers.1.'"
    assert reasons["model.layers.0.mlp.down_proj"] == "in_features=40, out_features=32: not multiples of 16"
    assert (
        "model.layers.0.mlp.gate_proj (in_features=32, out_features=40: not multiples of 16)" in caplog.text
    )


def test_off_by_default_converts_nothing():
    model = _meta("llama")
    parallelize(model, config=ParallelConfig())
    assert not any(isinstance(m, Float8Linear) for m in model.modules())


def test_config_validation():
    assert ParallelConfig().float8.recipe is None
    cfg = ParallelConfig.model_validate({"float8": {"recipe": "tensorwise", "fsdp_float8_all_gather": False}})
    assert cfg.float8.recipe == "tensorwise" and cfg.float8.enabled
    with pytest.raises(ValidationError, match="fsdp_float8_all_gather needs recipe = 'tensorwise'"):
        Float8Training(recipe="rowwise", fsdp_float8_all_gather=True)
    with pytest.raises(ValidationError, match="recipe"):
        ParallelConfig.model_validate({"float8": {"recipe": "blockwise"}})
    with pytest.raises(ValidationError, match="scaling"):
        ParallelConfig.model_validate({"float8": {"recipe": "rowwise", "scaling": "x"}})


def test_missing_torchao_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    with pytest.raises(ImportError, match=r'pip install "plait-models\[float8\]"'):
        apply_float8(_meta("llama"), Float8Training(**EMULATED))
    with pytest.raises(ImportError, match=r"plait-models\[float8\]"):
        check_float8(Float8Training(recipe="tensorwise"))
    apply_float8(_meta("llama"), Float8Training())  # off: torchao is not needed
    check_float8(Float8Training())


def test_device_without_float8_gemms_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match=r"compute capability 8\.9\+.*no CUDA device.*emulate"):
        apply_float8(_meta("llama"), Float8Training(recipe="tensorwise"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(RuntimeError, match=r"NVIDIA A100-SXM4-80GB is sm_80"):
        check_float8(Float8Training(recipe="rowwise"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    check_float8(Float8Training(recipe="rowwise"))  # Hopper
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    check_float8(Float8Training(recipe="rowwise", emulate=True))


# --- numerics: emulated float8 GEMMs against the quantisation written out ---


def _fp8(t: torch.Tensor, dim: int | None, dtype: torch.dtype, pow2: bool) -> torch.Tensor:
    """``t`` rounded to float8 with a dynamic scale (per tensor, or per slice along ``dim``), dequantised."""
    amax = t.abs().amax() if dim is None else t.abs().amax(dim=dim, keepdim=True)
    fmax = torch.finfo(dtype).max
    scale = (fmax / amax.double().clamp(min=1e-12)).float()
    if pow2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return (t.float() * scale).clamp(-fmax, fmax).to(dtype).float() / scale


def _reference(recipe: str, x, w, go):
    """y = x @ w.T and its gradients with each GEMM's operands rounded as the recipe says."""
    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    if recipe == "tensorwise":  # one scale per tensor; gradients in e5m2
        xq, wq, gq = _fp8(x, None, e4, False), _fp8(w, None, e4, False), _fp8(go, None, e5, False)
        return xq @ wq.T, gq @ wq, gq.T @ xq
    # rowwise: scales along each GEMM's contracted dim, powers of two; gradients in e4m3
    y = _fp8(x, -1, e4, True) @ _fp8(w, -1, e4, True).T
    gx = _fp8(go, -1, e4, True) @ _fp8(w, 0, e4, True)
    gw = _fp8(go, 0, e4, True).T @ _fp8(x, 0, e4, True)
    return y, gx, gw


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_emulated_float8_linear_matches_the_written_out_quantisation(recipe):
    torch.manual_seed(0)
    x = torch.randn(64, 48) * torch.logspace(-1, 1, 64)[:, None]  # rows of different scales
    w = torch.randn(32, 48) * 0.1
    go = torch.randn(64, 32)
    model = nn.Sequential(nn.Linear(48, 32, bias=False))
    model[0].weight.data.copy_(w)
    ao = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=True)
    convert_to_float8_training(model, config=ao)
    xr = x.clone().requires_grad_(True)
    y = model(xr)
    y.backward(go)
    ref_y, ref_gx, ref_gw = _reference(recipe, x, w, go)
    torch.testing.assert_close(y, ref_y, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(xr.grad, ref_gx, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model[0].weight.grad, ref_gw, rtol=1e-5, atol=1e-4)
    # and float8 it is: a few percent from the fp32 product, no more
    rel = ((y - x @ w.T).norm() / (x @ w.T).norm()).item()
    assert 1e-3 < rel < 0.08, rel


def test_emulated_float8_model_trains_close_to_fp32():
    """The whole path (provider -> parallelize -> materialise): a Llama-shaped stage with float8
    linears gives a loss and gradients within float8 error of the fp32 model from the same init."""
    cfg = LlamaConfig(**ATTN_DIMS, intermediate_size=48, num_hidden_layers=2)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    results = []
    for parallel in (ParallelConfig(), ParallelConfig(float8=Float8Training(**EMULATED))):
        provider = CausalLMProvider(cfg, parallel=parallel, seed=5)
        stage = provider.parallelize(provider.build_stage(0, 1), None)
        provider.materialize(stage, torch.device("cpu"))
        out = stage(input_ids=ids, labels=ids)
        out["loss"].backward()
        grads = {n: p.grad for n, p in stage.named_parameters()}
        results.append((stage, out["loss"].item(), grads))
    (ref, ref_loss, ref_grads), (f8, loss, grads) = results
    assert sum(isinstance(m, Float8Linear) for m in f8.modules()) == 14  # 2 x (4 attn + 3 mlp)
    assert not any(isinstance(m, Float8Linear) for m in ref.modules())
    assert loss == pytest.approx(ref_loss, rel=2e-2)
    assert loss != ref_loss
    for name, g in ref_grads.items():
        rel = ((grads[name] - g).norm() / g.norm()).item()
        assert rel < 0.15, (name, rel)


# --- parallel layouts (gloo): float8 linears under TP and FSDP2 equal the single-process float8 model ---

DENSE = ("pp", "dp_replicate", "dp_cp_shard", "cp_replicate", "tp")
PARALLEL_CFG = LlamaConfig(**ATTN_DIMS, intermediate_size=48, num_hidden_layers=2)


def _ids() -> torch.Tensor:
    return torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))


def _rank_float8(mesh_shape: tuple[int, ...], recipe: str, ckpt: str, export: str) -> dict:
    import torch.distributed as dist
    from plait.models import load_hf_checkpoint, save_hf_checkpoint
    from plait.models.common.parallel import precompute_float8_scales
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    with torch.device("meta"):
        model = build_causal_lm(PARALLEL_CFG)
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=DENSE)
    parallelize(
        model, dense_mesh=mesh, config=ParallelConfig(float8=Float8Training(recipe=recipe, emulate=True))
    )
    model.to_empty(device="cpu")
    model.reset_parameters()
    load_hf_checkpoint(model, ckpt)  # into the float8 all-gather weights too
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)  # sum over ranks
            m.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    world = dist.get_world_size()
    # Every rank runs the whole batch (tensorwise activation scales depend on the rows a rank holds):
    # the gradients summed over FSDP's ranks are world x the single-process ones.
    out = model(input_ids=_ids(), labels=_ids())
    out["loss"].backward()
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        grads[name] = g / (world if mesh_shape[2] > 1 else 1)
    precompute_float8_scales([model])  # the next all-gather's scales, from the (unchanged) weights
    with torch.no_grad():
        again = model(input_ids=_ids(), labels=_ids())["loss"].item()
    save_hf_checkpoint(model, export)  # collective; reads through the float8 all-gather weights
    locals_ = {type(p.to_local()).__name__ for p in model.parameters() if isinstance(p, DTensor)}
    return {"loss": out["loss"].item(), "again": again, "grads": grads, "local_types": locals_}


@pytest.mark.parametrize(
    "layout,recipe",
    [("tp2", "tensorwise"), ("tp2", "rowwise"), ("fsdp2", "tensorwise")],
)
def test_parallel_layouts_match_the_single_process_float8_model(layout, recipe, tmp_path):
    from plait.models import load_hf_checkpoint, save_hf_checkpoint

    run_distributed = pytest.importorskip("plait.dist_core.testing").run_distributed
    torch.manual_seed(0)
    ref = build_causal_lm(PARALLEL_CFG)
    ref.reset_parameters()
    ckpt = str(save_hf_checkpoint(ref, tmp_path / "seed"))
    apply_float8(ref, Float8Training(recipe=recipe, emulate=True))
    out = ref(input_ids=_ids(), labels=_ids())
    out["loss"].backward()
    shape = (1, 1, 1, 1, 2) if layout == "tp2" else (1, 1, 2, 1, 1)
    export = tmp_path / "export"
    results = run_distributed(_rank_float8, 2, shape, recipe, ckpt, str(export), timeout=240.0)
    for r in results:
        assert r["loss"] == pytest.approx(out["loss"].item(), abs=1e-5)
        assert r["again"] == pytest.approx(r["loss"], abs=1e-6)
    if layout == "fsdp2":  # tensorwise under FSDP2: the weights are all-gathered in float8
        assert "WeightWithDynamicFloat8CastTensor" in results[0]["local_types"]
    for name, p in ref.named_parameters():
        torch.testing.assert_close(results[0]["grads"][name], p.grad, atol=1e-5, rtol=1e-4, msg=name)
    # the export holds the checkpoint's weights (nothing trained in between)
    with torch.device("meta"):
        again = build_causal_lm(PARALLEL_CFG)
    again.to_empty(device="cpu")
    load_hf_checkpoint(again, export)
    for (name, p), (_, q) in zip(ref.named_parameters(), again.named_parameters(), strict=True):
        assert torch.equal(p.detach(), q.detach()), name


def test_expert_conversion_lists_the_routed_experts():
    """``experts=True`` adds every MoE layer's routed experts (widths multiples of 16); the shared
    expert stays a set of linears, the router stays in high precision."""
    model = _meta("qwen3_moe")
    plan = float8_linears(model, experts=True)
    assert [n for n in plan.converted if n.endswith("experts")] == [
        "model.layers.0.mlp.experts",
        "model.layers.2.mlp.experts",
    ]
    plan = float8_linears(_meta("qwen3_moe"), skip=("layers.2.",), experts=True)
    assert dict(plan.skipped)["model.layers.2.mlp.experts"] == "matches parallel.float8.skip 'layers.2.'"
    odd = GptOssConfig(**{**ATTN_DIMS, "hidden_size": 24, "head_dim": 6}, intermediate_size=16,
                       num_hidden_layers=1, num_experts=4, num_experts_per_tok=2, sliding_window=4)  # fmt: skip
    with torch.device("meta"):
        plan = float8_linears(build_causal_lm(odd), experts=True)
    assert dict(plan.skipped)["model.layers.0.mlp.experts"] == "hidden_size=24: not multiples of 16"
    with pytest.raises(ValidationError, match=r"float8\.experts needs float8 grouped GEMMs on a GPU"):
        Float8Training(recipe="rowwise", experts=True, emulate=True)


def test_aligned_rows_start_every_group_at_a_multiple_of_16():
    counts = torch.tensor([0, 5, 16, 17, 0, 1])
    dest, ends, size = aligned_rows(counts, 45)  # 39 rows in groups, 6 past them
    assert ends.dtype == torch.int32 and ends.tolist() == [0, 16, 32, 64, 64, 80]
    assert size == 144  # 45 + 15 * 6 = 135, rounded up to a multiple of 16
    want = list(range(0, 5)) + list(range(16, 32)) + list(range(32, 49)) + [64] + list(range(80, 86))
    assert dest.tolist() == want


def test_float8_grouped_mm_pads_groups_and_matches_gmm(monkeypatch):
    """The padding and gathering around torchao's float8 grouped GEMM, with the GEMM replaced by a
    float64 one that checks torchao's contract (int32 ends at multiples of 16, row-major A,
    column-major B, zero rows between groups): output and gradients equal a per-expert matmul."""
    import torchao.prototype.moe_training as moe_training

    def grouped_mm_64(a, b_t, ends, out_dtype, pad_token_groups_for_grouped_mm):
        assert not pad_token_groups_for_grouped_mm and ends.dtype == torch.int32
        assert all(int(e) % 16 == 0 for e in ends) and a.shape[0] % 16 == 0
        assert a.stride(-1) == 1 and b_t.stride(-2) == 1  # row-major A, column-major B
        out, start = [], 0
        for e, end in enumerate(ends.tolist()):
            out.append(a[start:end].double() @ b_t[e].double())
            start = end
        out.append(a.new_zeros(a.shape[0] - start, b_t.shape[-1]).double())
        return torch.cat(out).to(out_dtype)

    monkeypatch.setattr(moe_training, "_to_fp8_rowwise_then_scaled_grouped_mm", grouped_mm_64)
    torch.manual_seed(0)
    counts = torch.tensor([3, 0, 16, 21])
    x = torch.randn(45, 32, requires_grad=True)  # 40 rows in groups, 5 past them
    w = torch.randn(4, 48, 32, requires_grad=True)
    y = float8_grouped_mm(x, w, counts)
    dy = torch.randn_like(y)
    (y[:40] * dy[:40]).sum().backward()
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref, start = [], 0
    for e, n in enumerate(counts.tolist()):
        ref.append(x64[start : start + n] @ w64[e].T)
        start += n
    ref64 = torch.cat(ref)
    (ref64 * dy[:40].double()).sum().backward()
    assert y.dtype == x.dtype and y.shape == (45, 48)
    torch.testing.assert_close(y[:40].double(), ref64, atol=0.1, rtol=1e-2)  # the product is rounded to bf16
    torch.testing.assert_close(x.grad[:40].double(), x64.grad[:40], atol=0.1, rtol=1e-2)
    assert x.grad[40:].abs().sum() == 0
    torch.testing.assert_close(w.grad.double(), w64.grad, atol=0.3, rtol=1e-2)


def test_float8_experts_are_wired_into_the_grouped_experts(monkeypatch):
    monkeypatch.setattr("plait.models.common.parallel.float8.check_float8", lambda config: None)
    model = _meta("qwen3_moe")
    apply_float8(model, Float8Training(recipe="rowwise", experts=True))
    experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    assert len(experts) == 2 and all(m.grouped_mm is float8_grouped_mm for m in experts)
    plain = _meta("qwen3_moe")
    apply_float8(plain, Float8Training(recipe="rowwise", emulate=True))
    assert all(
        m.grouped_mm is not float8_grouped_mm for m in plain.modules() if isinstance(m, GroupedExperts)
    )
