"""Expert LoRA on plait.moe experts with biases and the clamped SwiGLU, against transformers' gpt-oss
block (fp32): the forward equals GptOssMLP with the merged weights W + s B A, the adapter gradients
follow from its weight gradients, and the adapter exported in the HF PEFT format runs in ``peft`` on
GptOssMLP (and imports back) with the same output."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from plait.moe import (  # noqa: E402
    ClampedSwiGLU,
    MoELayer,
    MoEOutput,
    RouterConfig,
    down_from_input_major,
    down_to_input_major,
    gate_up_bias_from_interleaved,
    gate_up_from_input_major_interleaved,
    gate_up_to_input_major_interleaved,
    interleaved_order,
)
from plait.peft import (  # noqa: E402
    ExpertLoRA,
    FullTuneConfig,
    LoRAConfig,
    PeftStackConfig,
    apply_peft,
    merge_peft,
)
from plait.peft.hf import export_hf_adapter, import_hf_adapter  # noqa: E402
from plait.peft.io import load_adapter, read_adapter_config, save_adapter  # noqa: E402
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP  # noqa: E402

H, FFN, E, K = 12, 10, 6, 3
EXPERTS = r"mlp\.experts\.(gate_up_proj|down_proj)"


class Block(torch.nn.Module):
    """One MoE block under the name ``mlp`` (plait's or transformers'), returning its output tensor."""

    def __init__(self, mlp: torch.nn.Module) -> None:
        super().__init__()
        self.mlp = mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.mlp(x)
        return out.hidden_states if isinstance(out, MoEOutput) else out[0]


def _hf_block(seed: int = 0) -> Block:
    cfg = transformers.GptOssConfig(
        hidden_size=H, intermediate_size=FFN, num_local_experts=E, num_experts_per_tok=K, swiglu_limit=1.5
    )
    mlp = GptOssMLP(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.8)
    return Block(mlp)


def _plait_block(hf: Block) -> Block:
    layer = MoELayer(
        H,
        FFN,
        E,
        RouterConfig(score_func="softmax_over_topk", logit_bias=True, top_k=K),
        expert_activation=ClampedSwiGLU(alpha=1.702, limit=1.5),
        expert_proj_bias=True,
    )
    src = hf.mlp
    with torch.no_grad():
        layer.router.weight.copy_(src.router.weight)
        layer.router.bias.copy_(src.router.bias)
        layer.experts.gate_up_proj.copy_(gate_up_from_input_major_interleaved(src.experts.gate_up_proj))
        layer.experts.gate_up_proj_bias.copy_(gate_up_bias_from_interleaved(src.experts.gate_up_proj_bias))
        layer.experts.down_proj.copy_(down_from_input_major(src.experts.down_proj))
        layer.experts.down_proj_bias.copy_(src.experts.down_proj_bias)
    return Block(layer)


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(2, 7, H, generator=g) * 2.0, torch.randn(2, 7, H, generator=g)


def _order(name: str) -> torch.Tensor | None:
    return interleaved_order(FFN) if name.endswith("gate_up_proj") else None


def test_expert_lora_with_biases_and_clamp_matches_merged_hf_block() -> None:
    hf = _hf_block()
    ours = _plait_block(hf)
    apply_peft(ours, LoRAConfig(r=2, alpha=4, target_parameters=EXPERTS, init="random"))
    x, grad_out = _inputs()
    ours(x).mul(grad_out).sum().backward()
    y = ours(x).detach()

    adapters = {name: ours.mlp.experts.lora[name] for name in ("gate_up_proj", "down_proj")}
    deltas = {}
    for name, ad in adapters.items():
        assert isinstance(ad, ExpertLoRA)
        deltas[name] = ad.scaling * ad.lora_B.detach() @ ad.lora_A.detach()  # [E, out, in], plait layout
    with torch.no_grad():  # HF's block with the effective weights W + s B A (converted to its layout)
        hf.mlp.experts.gate_up_proj += gate_up_to_input_major_interleaved(deltas["gate_up_proj"])
        hf.mlp.experts.down_proj += down_to_input_major(deltas["down_proj"])
    assert not torch.allclose(hf(x), _hf_block()(x), atol=1e-3), "the adapters must change the output"
    hf(x).mul(grad_out).sum().backward()
    torch.testing.assert_close(y, hf(x).detach(), atol=1e-5, rtol=1e-5)

    # dL/dA_e = s B_e^T dW_e and dL/dB_e = s dW_e A_e^T, with dW the HF weight gradient in plait's layout.
    hf_dw = {
        "gate_up_proj": gate_up_from_input_major_interleaved(hf.mlp.experts.gate_up_proj.grad),
        "down_proj": down_from_input_major(hf.mlp.experts.down_proj.grad),
    }
    for name, ad in adapters.items():
        a, b = ad.lora_A.detach(), ad.lora_B.detach()
        torch.testing.assert_close(
            ad.lora_A.grad, ad.scaling * b.transpose(1, 2) @ hf_dw[name], atol=1e-5, rtol=1e-4
        )
        torch.testing.assert_close(
            ad.lora_B.grad, ad.scaling * hf_dw[name] @ a.transpose(1, 2), atol=1e-5, rtol=1e-4
        )
    # Biases and base weights are frozen by apply_peft; only the adapters train.
    assert ours.mlp.experts.gate_up_proj_bias.grad is None and ours.mlp.experts.down_proj.grad is None


def test_expert_adapter_round_trips_through_peft_on_the_hf_block(tmp_path: Path) -> None:
    hf = _hf_block()
    ours = _plait_block(hf)
    apply_peft(ours, LoRAConfig(r=2, alpha=4, target_parameters=EXPERTS, init="random"))
    x, _ = _inputs()
    with torch.no_grad():
        y = ours(x)
    export_hf_adapter(ours, tmp_path, expert_out_order=_order)

    theirs = peft.PeftModel.from_pretrained(_hf_block(), str(tmp_path)).eval()
    with torch.no_grad():
        torch.testing.assert_close(theirs(x), y, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(_hf_block()(x), y, atol=1e-3), "the adapter must change the output"

    back = _plait_block(_hf_block())
    import_hf_adapter(back, tmp_path, expert_out_order=_order)
    with torch.no_grad():
        torch.testing.assert_close(back(x), y, atol=1e-6, rtol=1e-6)
    merge_peft(back)
    with torch.no_grad():
        torch.testing.assert_close(back(x), y, atol=1e-5, rtol=1e-5)

    # Without the order the exported gate/up rows land on the wrong HF columns: a different output.
    export_hf_adapter(ours, tmp_path / "unordered")
    wrong = peft.PeftModel.from_pretrained(_hf_block(), str(tmp_path / "unordered")).eval()
    with torch.no_grad():
        assert not torch.allclose(wrong(x), y, atol=1e-3)


def test_expert_out_order_must_be_a_permutation(tmp_path: Path) -> None:
    ours = _plait_block(_hf_block())
    apply_peft(ours, LoRAConfig(r=2, alpha=4, target_parameters=EXPERTS, init="random"))
    with pytest.raises(ValueError, match="expert_out_order"):
        export_hf_adapter(
            ours, tmp_path, expert_out_order=lambda name: torch.zeros(2 * FFN, dtype=torch.int64)
        )


def test_plait_adapter_file_with_trained_expert_biases_round_trips(tmp_path: Path) -> None:
    """Expert LoRA plus full-tuned expert biases (a PEFT stack) saved with plait's adapter IO and
    loaded into a fresh copy of the base layer: the same output; the biases are in the file."""
    stack = PeftStackConfig(
        methods=[
            LoRAConfig(r=2, alpha=4, target_parameters=EXPERTS, init="random"),
            FullTuneConfig(target_parameters=r"mlp\.experts\.(gate_up|down)_proj_bias"),
        ]
    )
    ours = _plait_block(_hf_block())
    apply_peft(ours, stack)
    with torch.no_grad():
        ours.mlp.experts.down_proj_bias.add_(0.5)  # "trained"
    x, _ = _inputs()
    with torch.no_grad():
        y = ours(x)
    saved = save_adapter(ours, tmp_path / "adapter.safetensors", stack)
    assert "mlp.experts.down_proj_bias" in saved and "mlp.experts.lora.gate_up_proj.lora_A" in saved

    back = _plait_block(_hf_block())
    apply_peft(back, read_adapter_config(tmp_path / "adapter.safetensors"))
    load_adapter(back, tmp_path / "adapter.safetensors")
    with torch.no_grad():
        torch.testing.assert_close(back(x), y, atol=0, rtol=0)
