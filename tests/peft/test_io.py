"""Adapter IO: only trainable parameters are saved; loading restores them; configs round-trip."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from plait.peft import FullTuneConfig, LoRAConfig, PeftStackConfig, apply_peft
from plait.peft.io import load_adapter, read_adapter_config, save_adapter
from safetensors.torch import load_file
from torch import nn


def tiny(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.LayerNorm(8), nn.Linear(8, 4))


CFG = PeftStackConfig(
    methods=[
        LoRAConfig(r=2, alpha=4, target_modules=r"0|3", init="random"),
        FullTuneConfig(target_parameters=r"2\.(weight|bias)"),
    ]
)


def test_save_load_roundtrip(tmp_path: Path) -> None:
    trained = tiny(0)
    apply_peft(trained, CFG)
    with torch.no_grad():
        trained[2].weight.add_(0.5)  # a full-tuned parameter that moved
    path = tmp_path / "adapter.safetensors"
    names = save_adapter(trained, path, CFG)
    assert set(names) == set(load_file(path)) == {n for n, p in trained.named_parameters() if p.requires_grad}
    assert not any("base_layer" in n for n in names)
    assert read_adapter_config(path) == CFG

    fresh = tiny(0)
    apply_peft(fresh, read_adapter_config(path))
    x = torch.randn(3, 6)
    assert not torch.allclose(fresh(x), trained(x))
    assert set(load_adapter(fresh, path)) == set(names)
    torch.testing.assert_close(fresh(x), trained(x), atol=0, rtol=0)


def test_load_errors(tmp_path: Path) -> None:
    model = tiny(0)
    apply_peft(model, LoRAConfig(r=2, target_modules="0"))
    path = tmp_path / "a.safetensors"
    save_adapter(model, path)
    assert read_adapter_config(path) is None
    other = tiny(0)
    apply_peft(other, LoRAConfig(r=2, target_modules="0|3"))
    with pytest.raises(KeyError, match="missing"):
        load_adapter(other, path)
    load_adapter(other, path, strict=False)
    wrong_rank = tiny(0)
    apply_peft(wrong_rank, LoRAConfig(r=3, target_modules="0"))
    with pytest.raises(ValueError, match=r"0\.lora_A\.weight: shape"):
        load_adapter(wrong_rank, path)
    with pytest.raises(ValueError, match="no trainable"):
        save_adapter(tiny(0).requires_grad_(False), path)
