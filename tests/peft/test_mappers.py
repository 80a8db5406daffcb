"""A base checkpoint (original key names) loads into the injected model through plait.model_state."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from plait.model_state import KeyMismatchError, Rename
from plait.peft import (
    DoRAConfig,
    LoRAConfig,
    apply_peft,
    base_to_injected,
    load_base_checkpoint,
)
from safetensors.torch import save_file
from torch import nn


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(6, 6)
        self.down = nn.Linear(6, 4, bias=False)
        self.experts = nn.Module()  # merge-only here: apply_peft(..., require_expert_hook=False)
        self.experts.w = nn.Parameter(torch.randn(2, 4, 6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.q_proj(x)) + (x @ self.experts.w.sum(0).T)


def _checkpoint(tmp_path: Path, prefix: str = "") -> tuple[Path, nn.Module]:
    torch.manual_seed(0)
    ref = Net()
    path = tmp_path / "model.safetensors"
    save_file({prefix + k: v.contiguous() for k, v in ref.state_dict().items()}, str(path))
    return path, ref


def test_base_checkpoint_loads_into_meta_injected_model(tmp_path: Path) -> None:
    path, ref = _checkpoint(tmp_path, prefix="model.")
    with torch.device("meta"):
        model = Net()
    apply_peft(
        model,
        [
            LoRAConfig(r=2, target_modules="q_proj", target_parameters=r"experts\.w"),
            DoRAConfig(r=2, target_modules="down"),
        ],
        require_expert_hook=False,
    )
    assert base_to_injected(model).renames == {
        "q_proj.weight": "q_proj.base_layer.weight",
        "q_proj.bias": "q_proj.base_layer.bias",
        "down.weight": "down.base_layer.weight",
    }
    result = load_base_checkpoint(model, path, Rename({"model.{*k}": "{k}"}))
    assert set(result.missing) == {
        "q_proj.lora_A.weight",
        "q_proj.lora_B.weight",
        "down.lora_A.weight",
        "down.lora_B.weight",
        "down.lora_magnitude_vector",
        "experts.lora.w.lora_A",
        "experts.lora.w.lora_B",
    }
    assert torch.equal(model.q_proj.base_layer.weight, ref.q_proj.weight)
    # adapters re-initialised after loading: zero B, DoRA magnitude = row norms of the loaded weight
    assert torch.equal(model.q_proj.lora_B.weight, torch.zeros(6, 2))
    torch.testing.assert_close(model.down.lora_magnitude_vector, ref.down.weight.norm(dim=1))
    x = torch.randn(3, 6)
    torch.testing.assert_close(model(x), ref(x), atol=1e-6, rtol=1e-6)


def test_load_base_checkpoint_reports_real_missing_keys(tmp_path: Path) -> None:
    torch.manual_seed(0)
    path = tmp_path / "partial.safetensors"
    save_file({"q_proj.weight": torch.randn(6, 6)}, str(path))
    model = Net()
    apply_peft(model, LoRAConfig(r=2, target_modules="q_proj"))
    with pytest.raises(KeyMismatchError, match=r"q_proj\.bias"):
        load_base_checkpoint(model, path)
