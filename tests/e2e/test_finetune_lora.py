"""LoRA fine-tuning example: trains only adapters from an HF checkpoint and exports a PEFT adapter
that the real ``peft`` loads onto the transformers model with plait's logits."""

from __future__ import annotations

import sys
from pathlib import Path

import peft
import torch
from transformers import AutoModelForCausalLM

from tests.e2e._pretrain_runner import EXAMPLE_DIR, FAST, run


def test_finetune_lora_exports_an_adapter_peft_loads(tmp_path: Path) -> None:
    seed = tmp_path / "base"
    run([*FAST, f"--write-seed-checkpoint={seed}"])
    if str(EXAMPLE_DIR) not in sys.path:
        sys.path.insert(0, str(EXAMPLE_DIR))
    import finetune_lora

    adapter = finetune_lora.main(
        [
            "--base",
            str(seed),
            "--steps",
            "3",
            "--run-dir",
            str(tmp_path / "lora"),
            *FAST,
            "--optimizer.lr=0.01",
        ]
    )
    assert (adapter / "adapter_model.safetensors").is_file() and (adapter / "adapter_config.json").is_file()

    from plait.models import from_pretrained
    from plait.peft import import_hf_adapter

    ids = torch.tensor([list(b"def main():\n    return 0\n"), list(b"import os; print(os.sep)\n")])
    base = AutoModelForCausalLM.from_pretrained(seed, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        base_logits = base(ids).logits
    theirs = peft.PeftModel.from_pretrained(base, str(adapter)).eval()
    ours = from_pretrained(seed).eval()
    import_hf_adapter(ours, adapter)
    with torch.no_grad():
        their_logits = theirs(ids).logits
        our_logits = ours(input_ids=ids, return_logits=True)["logits"]
    assert not torch.allclose(their_logits, base_logits, atol=1e-4), "training must have moved the adapters"
    torch.testing.assert_close(our_logits, their_logits, atol=1e-4, rtol=1e-4)
