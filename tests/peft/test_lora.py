"""LoRA/DoRA on nn.Linear: injection, numerics against float64 formulas, merge/unmerge, gradients."""

from __future__ import annotations

import copy

import pytest
import torch
from plait.peft import (
    DoRAConfig,
    DoRALinear,
    FullTuneConfig,
    LoRAConfig,
    LoRALinear,
    PeftConfig,
    PeftStackConfig,
    apply_peft,
    merge_and_unload,
    merge_peft,
    unmerge_peft,
)
from pydantic import TypeAdapter, ValidationError
from torch import nn


class Block(nn.Module):
    def __init__(self, d: int = 12) -> None:
        super().__init__()
        self.q_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, 8, bias=True)
        self.o_proj = nn.Linear(8, d, bias=True)
        self.norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.o_proj(torch.tanh(self.v_proj(self.q_proj(x)))))


def tiny(seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(Block(), Block()).to(dtype)


ATTN = r".*\.(q|v|o)_proj"


@pytest.mark.parametrize(
    "cfg",
    [
        LoRAConfig(r=4, alpha=8, target_modules=ATTN),
        LoRAConfig(r=4, alpha=8, target_modules=["q_proj", "o_proj"], init="gaussian"),
        LoRAConfig(r=3, alpha=5, target_modules=ATTN, init="pissa", use_rslora=True),
        DoRAConfig(r=4, alpha=8, target_modules=ATTN),
    ],
    ids=["kaiming", "gaussian-list", "pissa-rslora", "dora"],
)
def test_injection_keeps_forward(cfg: LoRAConfig | DoRAConfig) -> None:
    model, ref = tiny(), tiny()
    x = torch.randn(5, 12)
    report = apply_peft(model, cfg)
    assert report.adapted
    torch.testing.assert_close(model(x), ref(x), atol=1e-5, rtol=1e-5)


def test_lora_matches_float64_formula() -> None:
    torch.manual_seed(1)
    base = nn.Linear(10, 6)
    w, b = base.weight.detach().double().clone(), base.bias.detach().double().clone()
    mod = LoRALinear(base, r=3, alpha=7.0, init="random", use_rslora=True)
    a, bb = mod.lora_A.weight.detach().double(), mod.lora_B.weight.detach().double()
    x = torch.randn(4, 10)
    s = 7.0 / 3**0.5
    expected = x.double() @ w.T + b + s * (x.double() @ a.T @ bb.T)
    torch.testing.assert_close(mod(x).double(), expected, atol=1e-5, rtol=1e-5)
    assert mod.scaling == pytest.approx(s)
    assert not torch.equal(bb, torch.zeros_like(bb))


def test_dora_matches_float64_formula() -> None:
    torch.manual_seed(2)
    base = nn.Linear(10, 6)
    w, b = base.weight.detach().double().clone(), base.bias.detach().double().clone()
    mod = DoRALinear(base, r=2, alpha=4.0, init="random")
    with torch.no_grad():
        mod.lora_magnitude_vector.mul_(torch.linspace(0.5, 1.5, 6))  # trained magnitude != initial norm
    a, bb = mod.lora_A.weight.detach().double(), mod.lora_B.weight.detach().double()
    m = mod.lora_magnitude_vector.detach().double()
    v = w + 2.0 * bb @ a
    w_eff = (m / v.norm(dim=1)).unsqueeze(1) * v
    x = torch.randn(4, 10)
    torch.testing.assert_close(mod(x).double(), x.double() @ w_eff.T + b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("method", ["lora", "dora"])
def test_merge_equals_unmerged_and_unmerge_restores(method: str) -> None:
    model = tiny()
    cls = LoRAConfig if method == "lora" else DoRAConfig
    apply_peft(model, cls(r=4, alpha=8, target_modules=ATTN, init="random"))
    base = {n: p.detach().clone() for n, p in model.named_parameters() if "base_layer" in n}
    x = torch.randn(5, 12)
    y = model(x)
    assert merge_peft(model) == 6
    torch.testing.assert_close(model(x), y, atol=2e-6, rtol=1e-5)
    assert any(not torch.equal(p, base[n]) for n, p in model.named_parameters() if n in base)
    assert unmerge_peft(model) == 6
    for n, p in model.named_parameters():
        if n in base:  # float32: W + d - d is W up to one rounding of the merged value
            torch.testing.assert_close(p, base[n], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(model(x), y, atol=2e-6, rtol=1e-5)
    # bit-exact with keep_original
    merge_peft(model, keep_original=True)
    unmerge_peft(model)
    after = {n: p.detach().clone() for n, p in model.named_parameters() if n in base}
    merge_peft(model, keep_original=True)
    unmerge_peft(model)
    for n, p in model.named_parameters():
        if n in after:
            assert torch.equal(p, after[n])


def test_merge_bf16_computes_delta_in_fp32() -> None:
    torch.manual_seed(3)
    base = nn.Linear(16, 8).to(torch.bfloat16)
    w = base.weight.detach().float().clone()
    mod = LoRALinear(base, r=2, alpha=2.0, init="random")
    a, b = mod.lora_A.weight.float(), mod.lora_B.weight.float()
    mod.merge()
    assert torch.equal(mod.base_layer.weight, (w + (b @ a)).to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="already merged"):
        mod.merge()


def test_merge_and_unload_restores_structure() -> None:
    model, ref = tiny(), tiny()
    apply_peft(model, LoRAConfig(r=2, target_modules=ATTN, init="random"))
    x = torch.randn(3, 12)
    y = model(x)
    merge_and_unload(model)
    assert set(model.state_dict()) == set(ref.state_dict())
    assert not any(isinstance(m, LoRALinear) for m in model.modules())
    torch.testing.assert_close(model(x), y, atol=2e-6, rtol=1e-5)


def test_only_adapters_get_grads_and_stacking() -> None:
    model = tiny()
    stack = PeftStackConfig(
        methods=[
            {"method": "lora", "r": 2, "target_modules": r".*\.q_proj", "init": "random"},
            {"method": "dora", "r": 2, "target_modules": r".*\.v_proj"},
            {"method": "full", "target_parameters": r".*\.norm\.weight|1\.o_proj\.bias"},
        ]
    )
    report = apply_peft(model, stack)
    assert [a.method for a in report.adapted] == ["lora", "lora", "dora", "dora"]
    # the full-tune regex is written against original names, matched after LoRA renamed nothing here
    assert set(report.full_tuned) == {"0.norm.weight", "1.norm.weight", "1.o_proj.bias"}
    model(torch.randn(4, 12)).square().sum().backward()
    expected = set(report.trainable)
    assert all(("lora_" in n) or n in report.full_tuned for n in expected)
    for n, p in model.named_parameters():
        assert (p.grad is not None) == (n in expected), n
    assert report.num_trainable == sum(p.numel() for n, p in model.named_parameters() if n in expected)


def test_full_tune_matches_pre_injection_names() -> None:
    model = tiny()
    report = apply_peft(
        model, [LoRAConfig(r=2, target_modules=ATTN), FullTuneConfig(target_parameters=r"0\.q_proj\.weight")]
    )
    assert report.full_tuned == ("0.q_proj.base_layer.weight",)
    assert model[0].q_proj.base_layer.weight.requires_grad
    assert not model[1].q_proj.base_layer.weight.requires_grad


def test_discriminated_union_and_errors() -> None:
    ta = TypeAdapter(PeftConfig)
    assert isinstance(ta.validate_python({"method": "dora", "target_modules": "x"}), DoRAConfig)
    assert isinstance(ta.validate_python({"method": "full", "target_parameters": "x"}), FullTuneConfig)
    with pytest.raises(ValidationError, match="method"):
        ta.validate_python({"method": "ia3", "target_modules": "x"})
    with pytest.raises(ValidationError, match="target_modules"):
        LoRAConfig(r=2, target_modules="(")
    with pytest.raises(ValidationError, match="target_modules and/or target_parameters"):
        LoRAConfig(r=2)
    with pytest.raises(ValidationError):
        LoRAConfig(r=0, target_modules="x")
    cfg = LoRAConfig(r=2, target_modules=ATTN)
    with pytest.raises(ValidationError):
        cfg.r = 3  # frozen
    model = tiny()
    with pytest.raises(ValueError, match="matched no module"):
        apply_peft(copy.deepcopy(model), LoRAConfig(target_modules=r".*\.k_proj"))
    with pytest.raises(ValueError, match="LayerNorm"):
        apply_peft(copy.deepcopy(model), LoRAConfig(target_modules=r".*\.norm"))
    with pytest.raises(ValueError, match="already adapted"):
        apply_peft(model, [LoRAConfig(target_modules=ATTN), DoRAConfig(target_modules=r"0\.q_proj")])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_adapter_init_does_not_depend_on_the_cuda_generator() -> None:
    # Sharded (DTensor) random ops advance the CUDA generator differently from plain ones, so an init
    # drawn from it would differ between a 1-GPU and an FSDP2 run; the adapters are drawn on the CPU.
    ref, got = nn.Sequential(nn.Linear(64, 32)), nn.Sequential(nn.Linear(64, 32)).cuda()
    for m in (ref, got):
        apply_peft(m, LoRAConfig(r=4, target_modules=".*"))
    torch.manual_seed(0)
    ref[0].reset_adapter_parameters()
    torch.manual_seed(0)
    torch.rand(12345, device="cuda")  # other CUDA draws in between
    got[0].reset_adapter_parameters()
    assert isinstance(got[0], LoRALinear) and got[0].lora_A.weight.is_cuda
    assert torch.equal(got[0].lora_A.weight.cpu(), ref[0].lora_A.weight)
    assert bool(ref[0].lora_A.weight.abs().sum() > 0)
