"""LoRA fine-tuning example: trains only adapters from an HF checkpoint and exports a PEFT adapter
that the real ``peft`` loads onto the transformers model with plait's logits."""

from __future__ import annotations

from pathlib import Path

import peft
import pytest
import torch
from plait.dist_core.testing import run_distributed
from plait.train.finetune import main as finetune
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from tests.e2e._pretrain_runner import FAST, run


def _finetune(argv: list[str]) -> str:
    """``finetune(argv)`` in this process (one rank under the harness): the adapter directory."""

    return str(finetune(argv))


def test_finetune_lora_exports_an_adapter_peft_loads(tmp_path: Path) -> None:
    seed = tmp_path / "base"
    run([*FAST, f"--write-seed-checkpoint={seed}"])

    adapter = finetune(
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


def test_finetune_lora_fsdp2_exports_the_one_process_adapter(tmp_path: Path) -> None:
    """With FSDP2 the export gathers the sharded adapters on every rank (a collective) and rank 0 writes
    the adapter the one-process run writes."""
    seed = tmp_path / "base"
    run([*FAST, f"--write-seed-checkpoint={seed}"])

    def argv(name: str) -> list[str]:
        return ["--base", str(seed), "--steps", "3", "--run-dir", str(tmp_path / name), *FAST,
                "--optimizer.lr=0.01", "--batching.microbatch_size=4"]  # fmt: skip

    single = Path(_finetune(argv("single")))
    fsdp2 = Path(run_distributed(_finetune, 2, [*argv("fsdp2"), "--mesh.data_shard=2"], timeout=300)[0])
    want = load_file(single / "adapter_model.safetensors")
    got = load_file(fsdp2 / "adapter_model.safetensors")
    assert sorted(got) == sorted(want)
    assert any(k.endswith("lora_B.weight") and v.abs().max() > 0 for k, v in want.items()), (
        "adapters must train"
    )
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-4, atol=1e-5, msg=key)


def _fails(capsys, argv: list[str]) -> str:
    """The one stderr message of a start-up error of ``finetune(argv)`` (exit status 2)."""

    with pytest.raises(SystemExit) as e:
        finetune(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "Traceback" not in err, err
    return err


def test_startup_errors_are_one_message_with_status_2(tmp_path: Path, capsys) -> None:
    run_dir = ["--run-dir", str(tmp_path / "lora")]
    err = _fails(capsys, ["--base", str(tmp_path / "missing"), *run_dir])
    assert f"error: --base: {tmp_path / 'missing'} is not a directory" in err
    (tmp_path / "empty").mkdir()
    err = _fails(capsys, ["--base", str(tmp_path / "empty"), *run_dir])
    assert f"--base: {tmp_path / 'empty'} holds no *.safetensors files" in err
    err = _fails(capsys, ["--base", str(tmp_path / "empty"), "--optimizer.lr=-1", *run_dir])
    assert "optimizer.lr: Input should be greater than 0" in err
    (tmp_path / "empty" / "model.safetensors").write_bytes(b"")
    err = _fails(capsys, ["--base", str(tmp_path / "empty"), *run_dir])  # no config.json
    assert f"--base: {tmp_path / 'empty'}: " in err

    # resuming a checkpoint that is past --steps: refused naming both, not "finished" and exported
    seed = tmp_path / "base"
    run([*FAST, f"--write-seed-checkpoint={seed}"])
    argv = ["--base", str(seed), *run_dir, *FAST, "--checkpoint.enabled=true", "--checkpoint.async_mode=off"]
    _finetune([*argv, "--steps", "2"])
    capsys.readouterr()
    err = _fails(capsys, [*argv, "--steps", "1"])
    assert "is at step 2, past run.steps=1" in err
