"""Grouped-expert LoRA against a per-expert float64 reference loop."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from plait.peft import (
    ExpertLoRA,
    LoRAConfig,
    apply_peft,
    expert_adapters,
    grouped_mm,
    merge_peft,
    unmerge_peft,
)
from torch import nn


class GroupedExperts(nn.Module):
    """Stand-in for plait.moe's experts: [E, out, in] weights, expert-contiguous rows, and the
    ExpertAdapterHost protocol (a user's own expert module, written without plait.moe)."""

    def __init__(self, e: int = 3, h: int = 8, i: int = 6) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(e, 2 * i, h) / h**0.5)
        self.down_proj = nn.Parameter(torch.randn(e, h, i) / i**0.5)
        self.lora = nn.ModuleDict()

    @property
    def adapters(self) -> nn.ModuleDict:
        return self.lora

    def attach_adapter(self, param_name: str, adapter: nn.Module) -> None:
        self.lora[param_name] = adapter

    def detach_adapters(self) -> None:
        self.lora.clear()

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        adapters = self.lora
        gu = grouped_mm(x, self.gate_up_proj, tokens_per_expert, trans_w=True)
        if "gate_up_proj" in adapters:
            gu = adapters["gate_up_proj"](gu, x, tokens_per_expert, gmm=grouped_mm)
        gate, up = gu.chunk(2, dim=-1)
        act = F.silu(gate) * up
        out = grouped_mm(act, self.down_proj, tokens_per_expert, trans_w=True)
        if "down_proj" in adapters:
            out = adapters["down_proj"](out, act, tokens_per_expert)
        return out


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = GroupedExperts()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, tpe: torch.Tensor) -> torch.Tensor:
        return self.experts(self.proj(x), tpe)


def reference(model: Model, x: torch.Tensor, tpe: torch.Tensor) -> torch.Tensor:
    """Per-expert loop in float64 with explicitly formed W_e + s B_e A_e."""
    ex = model.experts
    h = model.proj(x).double()

    def eff(name: str) -> torch.Tensor:
        w = getattr(ex, name).detach().double()
        if name in ex.lora:
            ad = ex.lora[name]
            w = w + ad.scaling * ad.lora_B.detach().double() @ ad.lora_A.detach().double()
        return w

    wgu, wd = eff("gate_up_proj"), eff("down_proj")
    outs, start = [], 0
    for e, n in enumerate(tpe.tolist()):
        xe = h[start : start + n]
        gate, up = (xe @ wgu[e].T).chunk(2, dim=-1)
        outs.append((F.silu(gate) * up) @ wd[e].T)
        start += n
    return torch.cat(outs)


TARGET = r"experts\.(gate_up_proj|down_proj)"


@pytest.mark.parametrize("init", ["kaiming", "random", "pissa"])
def test_expert_lora_equals_per_expert_reference(init: str) -> None:
    torch.manual_seed(0)
    model = Model()
    x, tpe = torch.randn(7, 8), torch.tensor([3, 0, 4])
    y0 = model(x, tpe).detach()
    report = apply_peft(model, LoRAConfig(r=2, alpha=3, target_parameters=TARGET, init=init))
    assert [a.name for a in report.adapted] == ["experts.gate_up_proj", "experts.down_proj"]
    assert set(report.trainable) == {
        f"experts.lora.{p}.lora_{ab}" for p in ("gate_up_proj", "down_proj") for ab in "AB"
    }
    assert tuple(model.experts.lora["gate_up_proj"].lora_A.shape) == (3, 2, 8)
    assert tuple(model.experts.lora["down_proj"].lora_B.shape) == (3, 8, 2)
    y = model(x, tpe)
    if init != "random":  # zero-B and PiSSA (residual base) keep the forward at init
        torch.testing.assert_close(y, y0, atol=1e-5, rtol=1e-5)
    if init == "kaiming":
        with torch.no_grad():  # non-zero B to test the adapter path itself
            for _, _, ad in expert_adapters(model):
                ad.lora_B.normal_()
        y = model(x, tpe)
    torch.testing.assert_close(y.double(), reference(model, x, tpe), atol=1e-5, rtol=1e-5)


def test_expert_lora_grads_and_merge() -> None:
    torch.manual_seed(1)
    model = Model()
    apply_peft(
        model, LoRAConfig(r=2, alpha=4, target_parameters=TARGET, init="random", target_modules="proj")
    )
    x, tpe = torch.randn(6, 8), torch.tensor([2, 2, 2])
    y = model(x, tpe)
    y.square().sum().backward()
    grads = {n for n, p in model.named_parameters() if p.grad is not None}
    assert grads == {n for n, p in model.named_parameters() if p.requires_grad}
    assert not model.experts.gate_up_proj.requires_grad and model.experts.gate_up_proj.grad is None
    base = model.experts.down_proj.detach().clone()
    merge_peft(model)
    assert all(ad.merged for _, _, ad in expert_adapters(model))
    torch.testing.assert_close(model(x, tpe), y, atol=2e-6, rtol=1e-5)
    unmerge_peft(model)
    torch.testing.assert_close(model.experts.down_proj.detach(), base, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(model(x, tpe), y, atol=2e-6, rtol=1e-5)


def test_expert_lora_errors() -> None:
    class Silent(nn.Module):  # a module whose forward would ignore adapters
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.zeros(2, 3, 4))

    with pytest.raises(ValueError, match="ExpertAdapterHost"):
        apply_peft(Silent(), LoRAConfig(target_parameters="w"))
    assert apply_peft(Silent(), LoRAConfig(target_parameters="w"), require_expert_hook=False).adapted
    model = Model()
    with pytest.raises(ValueError, match="3-D"):
        apply_peft(model, LoRAConfig(target_parameters=r"proj\.weight"))
    with pytest.raises(ValueError, match="matched no parameter"):
        apply_peft(model, LoRAConfig(target_parameters=r"experts\.up_proj"))
    ad = ExpertLoRA(model.experts.down_proj, "down_proj", r=2, alpha=2)
    with pytest.raises(ValueError, match="tokens_per_expert has 2 experts"):
        ad(torch.zeros(4, 8), torch.zeros(4, 6), torch.tensor([2, 2]))
