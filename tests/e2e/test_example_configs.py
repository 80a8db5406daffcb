"""Every config shipped under ``examples/`` loads with its command's config class, and (GPU) the main
job runs with the one-GPU config.

A config names the command it belongs to in its leading comments (``plait train``, ``plait finetune``);
that command's config class validates it, so a misplaced key (``model_dtype`` under
``[batching]``) fails here, on CPU, not at a user's first GPU run.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
from pathlib import Path

import pytest
from plait.loop import TrainerConfig, load_config
from plait.train import JobConfig
from plait.train.finetune import FinetuneConfig
from plait.train.train import DEFAULT_CONFIG

from tests.e2e._pretrain_runner import REPO, TRAIN_CMD, read_metrics

EXAMPLES = REPO / "examples"
CONFIGS = sorted(
    p
    for ext in ("toml", "yaml", "yml", "json")
    for pattern in (f"configs/*.{ext}", f"configs/*/*.{ext}")
    for p in EXAMPLES.rglob(pattern)
)


# The command a config's leading comment names -> the config class that validates it.
COMMANDS: dict[str, type[TrainerConfig]] = {"plait train": JobConfig, "plait finetune": FinetuneConfig}


def _config_class(config: Path) -> type[TrainerConfig]:
    """The config class of the command named in the config's leading comment lines."""
    lines = config.read_text().splitlines()
    header = "\n".join(
        line for line in lines[: next((i for i, x in enumerate(lines) if not x.startswith("#")), 0)]
    )
    found = [cls for command, cls in COMMANDS.items() if re.search(rf"{command}\b", header)]
    assert len(found) == 1, (
        f"{config}: its leading comments must name the command that runs it ({', '.join(COMMANDS)})"
    )
    return found[0]


def test_configs_are_found() -> None:
    names = {p.relative_to(EXAMPLES).as_posix() for p in CONFIGS}
    assert {
        "qwen3_moe/configs/gpu1.toml",
        "qwen3_moe/configs/gpu2.toml",
        "qwen3_moe/configs/gpu4.toml",
        "sft/configs/full.toml",
        "sft/configs/lora.toml",
        *(
            f"configs/{family}/{name}"
            for family in ("llama", "gpt_oss", "deepseek_v3")
            for name in ("cpu.toml", "gpu1.toml")
        ),
    } <= names


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.relative_to(EXAMPLES).as_posix())
def test_example_config_loads_with_its_config_class(config: Path) -> None:
    cls = _config_class(config)
    cfg = load_config(config, cls=cls)
    assert isinstance(cfg, cls)


def test_gpu_configs_train_bf16_compiled() -> None:
    for name in ("gpu1.toml", "gpu2.toml", "gpu4.toml"):
        path = EXAMPLES / "qwen3_moe" / "configs" / name
        cfg = load_config(path, cls=_config_class(path))
        assert cfg.model_dtype == "bfloat16" and cfg.parallel.compile and cfg.run.device == "cuda"


def test_shipped_main_job_configs_evaluate_on_held_out_files() -> None:
    for path in (DEFAULT_CONFIG, *(EXAMPLES / "qwen3_moe" / "configs" / f"gpu{n}.toml" for n in (1, 2, 4))):
        name = path.name
        cfg = load_config(path, cls=_config_class(path))
        assert cfg.evaluation.enabled and cfg.evaluation.interval is not None, name
        assert cfg.data.validation_files >= 1, name


@pytest.mark.gpu
@pytest.mark.timeout(900)
def test_main_job_runs_with_gpu1_config(tmp_path: Path) -> None:
    """The one-GPU command (compiled decoder layers, bf16) for 3 steps: finite losses, every step logged."""
    run_dir = tmp_path / "run"
    cmd = [*TRAIN_CMD, "--config", str(EXAMPLES / "qwen3_moe" / "configs" / "gpu1.toml")]
    cmd += ["--steps", "3", "--run-dir", str(run_dir), "--no-export", "--logging.interval=1"]
    cmd += ["--logging.progress_bar=false", "--checkpoint.enabled=false"]
    env = {k: v for k, v in os.environ.items() if k not in {"RANK", "WORLD_SIZE", "LOCAL_RANK"}}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=850)
    assert proc.returncode == 0, (
        f"plait train exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    )
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) for r in records)
    assert math.isfinite(records[-1]["val_loss"])  # the config's [evaluation] runs at the end
