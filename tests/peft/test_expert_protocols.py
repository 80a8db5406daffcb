"""plait.moe's experts and plait.peft's expert LoRA meet through typed protocols, not attribute names:
moe's GroupedExperts implements peft's ExpertAdapterHost, peft's ExpertLoRA provides moe's ExpertAdapter."""

from __future__ import annotations

import inspect

import pytest
import torch
from plait.moe import ExpertAdapter, GroupedExperts
from plait.peft import (
    ExpertAdapterHost,
    ExpertLoRA,
    LoRAConfig,
    apply_peft,
    attach_expert_adapter,
    detach_expert_adapters,
    expert_adapters,
    expert_adapters_of,
    merge_and_unload,
)
from torch import nn

TARGET = r"experts\.(gate_up_proj|down_proj)"


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = GroupedExperts(num_experts=3, hidden_size=8, intermediate_size=4)


def test_grouped_experts_is_an_adapter_host() -> None:
    experts = GroupedExperts(num_experts=3, hidden_size=8, intermediate_size=4)
    assert isinstance(experts, ExpertAdapterHost)
    assert not isinstance(nn.Linear(2, 2), ExpertAdapterHost)
    assert dict(experts.adapters) == {}
    assert experts.state_dict().keys() == {"gate_up_proj", "down_proj"}  # no adapter, no new key


def test_expert_lora_provides_the_expert_adapter_protocol() -> None:
    # The signature moe calls (adapter(out, x, tokens_per_expert, gmm=...)) is the one ExpertLoRA takes.
    theirs = inspect.signature(ExpertAdapter.forward).parameters
    ours = inspect.signature(ExpertLoRA.forward).parameters
    assert list(theirs) == list(ours)


def test_apply_peft_attaches_through_the_host_and_keeps_the_keys() -> None:
    torch.manual_seed(0)
    model = Model()
    report = apply_peft(model, LoRAConfig(r=2, target_parameters=TARGET, init="random"))
    assert [a.name for a in report.adapted] == ["experts.gate_up_proj", "experts.down_proj"]
    assert set(model.experts.adapters) == {"gate_up_proj", "down_proj"}
    assert all(isinstance(a, ExpertLoRA) for a in model.experts.adapters.values())
    assert set(report.trainable) == {
        f"experts.lora.{p}.lora_{ab}" for p in ("gate_up_proj", "down_proj") for ab in "AB"
    }
    # the forward calls them: a non-zero adapter changes the output
    x, tpe = torch.randn(5, 8), torch.tensor([2, 0, 3])
    y = model.experts(x, tpe)
    merged = merge_and_unload(model)
    assert dict(merged.experts.adapters) == {} and not list(expert_adapters(merged))
    torch.testing.assert_close(merged.experts(x, tpe), y, atol=1e-5, rtol=1e-5)
    assert merged.state_dict().keys() == {"experts.gate_up_proj", "experts.down_proj"}


def test_attach_adapter_errors() -> None:
    experts = GroupedExperts(num_experts=2, hidden_size=4, intermediate_size=2)
    ad = ExpertLoRA(experts.down_proj, "down_proj", r=1, alpha=1)
    with pytest.raises(ValueError, match="not one of"):
        experts.attach_adapter("gate_up_proj_bias", ad)
    with pytest.raises(TypeError, match=r"nn\.Module"):
        experts.attach_adapter("down_proj", object())  # type: ignore[arg-type]
    experts.attach_adapter("down_proj", ad)
    with pytest.raises(ValueError, match="already"):
        attach_expert_adapter(experts, "down_proj", ad)
    detach_expert_adapters(experts)
    assert dict(experts.adapters) == {}


def test_foreign_module_holds_adapters_only_when_asked() -> None:
    host = nn.Module()
    host.w = nn.Parameter(torch.zeros(2, 3, 4))
    assert expert_adapters_of(host) is None
    attach_expert_adapter(host, "w", ExpertLoRA(host.w, "w", r=1, alpha=1))
    held = expert_adapters_of(host)
    assert held is not None and set(held) == {"w"}
    assert set(host.state_dict()) == {"w", "lora.w.lora_A", "lora.w.lora_B"}
    detach_expert_adapters(host)
    assert expert_adapters_of(host) is None and set(host.state_dict()) == {"w"}
