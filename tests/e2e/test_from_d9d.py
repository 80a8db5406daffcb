"""End-to-end CPU tests of ``examples/from_d9d/train.py``, d9d's quickstart ported to plait.

1. The command from the migration guide (a subprocess, default config) trains the MLP; the exported
   safetensors, loaded into a plain ``torch.nn`` MLP, fit held-out samples of the same linear map
   near the noise floor; a rerun on the same run dir resumes the finished run and trains no more.
2. FSDP2 over 2 gloo ranks follows the single-process loss curve step for step.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from plait.dist_core.testing import run_distributed
from safetensors.torch import load_file, save_file
from torch import nn

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "examples" / "from_d9d" / "train.py"
QUIET = ["--logging.progress_bar=false"]


def _example() -> Any:
    """The example as a module (named uniquely: ``train`` is too common a name for sys.modules)."""
    name = "plait_example_from_d9d_train"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, TRAIN)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _run(argv: list[str]) -> dict[str, float]:
    """``train.main(argv)`` in this process (one rank under the harness)."""
    return _example().main(argv)  # type: ignore[no-any-return]


def _losses(run_dir: Path) -> dict[int, float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    return {int(r["step"]): float(r["loss"]) for r in records if "step" in r and "loss" in r}


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_guide_command_trains_exports_and_resumes(tmp_path: Path) -> None:
    run_dir, export = tmp_path / "run", tmp_path / "export"
    argv = [f"--run.run_dir={run_dir}", f"--export_to={export}", *QUIET]
    env = {k: v for k, v in os.environ.items() if k not in {"RANK", "WORLD_SIZE", "LOCAL_RANK"}}
    proc = subprocess.run(
        [sys.executable, str(TRAIN), *argv], cwd=REPO, env=env, capture_output=True, text=True, timeout=200
    )
    assert proc.returncode == 0, (
        f"train.py exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    )
    curve = _losses(run_dir)
    assert sorted(curve) == list(range(8, 65, 8)), sorted(curve)  # logging.interval = 8, 64 steps
    assert curve[64] < 0.01 * curve[8], f"the loss should fall by 100x in one pass: {curve}"
    assert (run_dir / "checkpoints" / "step_00000064" / "plait_checkpoint.json").is_file()

    # The exported weights in a model written here with torch.nn alone, on samples it never saw.
    state = load_file(export / "model.safetensors")
    assert sorted(state) == ["down.bias", "down.weight", "up.bias", "up.weight"]
    mlp = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
    mlp.load_state_dict({k.replace("up.", "0.").replace("down.", "2."): v for k, v in state.items()})
    data = _example().DataConfig()
    weight = _example().RegressionDataset(data, 16).weight  # the map the training data came from
    x = torch.randn(2048, 16, generator=torch.Generator().manual_seed(123))
    with torch.no_grad():
        mse = torch.mean((mlp(x) - x @ weight) ** 2).item()
    assert mse < 0.1, f"held-out MSE {mse} (targets have variance {float((x @ weight).var()):.1f})"

    # A rerun on the same run dir loads step 64's checkpoint: nothing left to train, nothing logged.
    before = (run_dir / "metrics.jsonl").read_text()
    _run([*argv, f"--export_to={tmp_path / 'export2'}"])
    assert (run_dir / "metrics.jsonl").read_text() == before
    again = load_file(tmp_path / "export2" / "model.safetensors")
    for key, value in state.items():
        torch.testing.assert_close(again[key], value, rtol=0, atol=0, msg=key)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_fsdp2_follows_the_single_process_curve(tmp_path: Path) -> None:
    # Both runs start from the same weights (a fresh init of a sharded model draws other numbers).
    torch.manual_seed(7)
    seed = tmp_path / "seed.safetensors"
    save_file(
        {k: v.contiguous() for k, v in _example().MLP(_example().ModelConfig()).state_dict().items()}, seed
    )

    def argv(name: str) -> list[str]:
        return [
            f"--init_from={seed}",
            f"--run.run_dir={tmp_path / name}",
            f"--export_to={tmp_path / name / 'export'}",
            "--run.steps=16",
            "--logging.interval=1",
            "--checkpoint.enabled=false",
            *QUIET,
        ]

    _run(argv("single"))
    run_distributed(_run, 2, [*argv("fsdp2"), "--mesh.data_shard=2"], timeout=200)
    single, fsdp2 = _losses(tmp_path / "single"), _losses(tmp_path / "fsdp2")
    assert sorted(single) == sorted(fsdp2) == list(range(1, 17))
    got = torch.tensor([fsdp2[s] for s in range(1, 17)], dtype=torch.float64)
    want = torch.tensor([single[s] for s in range(1, 17)], dtype=torch.float64)
    assert want[-1] < 0.5 * want[0], f"the loss should fall over 16 steps: {want}"
    torch.testing.assert_close(got, want, rtol=1e-4, atol=0.0)
    # Both runs export the same model: the FSDP2 shards are gathered into full tensors.
    a = load_file(tmp_path / "single" / "export" / "model.safetensors")
    b = load_file(tmp_path / "fsdp2" / "export" / "model.safetensors")
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-4, atol=1e-5, msg=key)
