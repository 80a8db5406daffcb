"""d9d's quickstart job, ported to plait: a small MLP learns a noisy linear map, on CPU in seconds.

    uv run examples/from_d9d/train.py                                    # one process
    uv run examples/from_d9d/train.py --run.steps=32 --optimizer.lr=3e-3  # dotted overrides
    uv run torchrun --nproc-per-node 2 examples/from_d9d/train.py --mesh.data_shard=2  # FSDP2 on gloo

``docs/migrating-from-d9d.md`` shows the d9d code each part replaces. The run logs the loss every
``logging.interval`` steps to the console and ``<run_dir>/metrics.jsonl``, saves checkpoints under
``<run_dir>/checkpoints`` (a rerun with the same run dir resumes, and a finished run does nothing
more), and writes the trained weights as safetensors to ``export_to``. ``--init_from=DIR`` starts from
saved weights instead (e.g. an export, or the same seed weights for runs with different layouts).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from plait.dist_core import fully_shard_module
from plait.loop import DatasetProvider, LossOutput, ModuleProvider, Trainer, TrainerConfig, load_config
from plait.model_state import load_module, save_module
from pydantic import BaseModel, ConfigDict, Field
from torch import nn
from torch.utils.data import Dataset

HERE = Path(__file__).resolve().parent
DEFAULT_CONFIG = HERE / "config.toml"


class ModelConfig(BaseModel):
    """Sizes of the MLP."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    num_features: int = Field(16, ge=1)
    hidden_size: int = Field(64, ge=1)


class DataConfig(BaseModel):
    """The synthetic regression data: ``y = x @ w + noise * eps`` for a fixed random ``w``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    num_samples: int = Field(8192, ge=1)
    noise: float = Field(0.1, ge=0)
    seed: int = 0


class RegressionConfig(TrainerConfig):
    """The loop's config plus this job's own sections (d9d: a project config holding ``trainer``)."""

    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    export_to: Path = Path("runs/from_d9d/export")
    init_from: Path | None = Field(
        None, description="Start from these safetensors weights instead of a fresh initialisation."
    )


class RegressionDataset(Dataset[dict[str, torch.Tensor]]):
    """Samples ``{"x": [F], "y": [1]}`` of a fixed random linear map plus Gaussian noise."""

    def __init__(self, config: DataConfig, num_features: int) -> None:
        g = torch.Generator().manual_seed(config.seed)
        self.x = torch.randn(config.num_samples, num_features, generator=g)
        self.weight = torch.randn(num_features, 1, generator=g)
        self.y = self.x @ self.weight + config.noise * torch.randn(config.num_samples, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[index], "y": self.y[index]}


def collate(samples: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack samples into one microbatch."""
    return {key: torch.stack([s[key] for s in samples]) for key in ("x", "y")}


class MLP(nn.Module):
    """A plain module: keyword tensors in, a dict of tensors out (plait's stage convention)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.up = nn.Linear(config.num_features, config.hidden_size)
        self.down = nn.Linear(config.hidden_size, 1)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"prediction": self.down(torch.relu(self.up(x)))}

    def reset_parameters(self) -> None:
        self.up.reset_parameters()
        self.down.reset_parameters()


class RegressionTask:
    """Batch -> model inputs; predictions -> a summed squared error (the loop divides by the sample count)."""

    def stage_inputs(
        self, batch: Mapping[str, torch.Tensor], stage_index: int, num_stages: int
    ) -> dict[str, torch.Tensor]:
        return {"x": batch["x"]}  # one stage: the whole model

    def num_loss_tokens(self, batch: Mapping[str, torch.Tensor]) -> int:
        return int(batch["y"].shape[0])  # the loop's "tokens" are this job's samples

    def loss(self, outputs: Mapping[str, torch.Tensor], batch: Mapping[str, torch.Tensor]) -> LossOutput:
        squared_error = F.mse_loss(outputs["prediction"], batch["y"], reduction="sum")
        return LossOutput(
            objective=squared_error,
            loss_sum=squared_error.detach(),
            num_tokens=self.num_loss_tokens(batch),
        )


def shard(module: nn.Module, ctx: Any, config: TrainerConfig) -> nn.Module:
    """FSDP2 (HSDP with ``mesh.data_replicate``) over the dense domain's data ranks; nothing on one process."""
    if ctx.params.data > 1:
        fully_shard_module(module, ctx.mesh_for("dense"))
    return module


def load_weights(path: Path, parts: Sequence[nn.Module]) -> None:
    """Called after ``reset_parameters()``: each rank reads only its FSDP shard of the file."""
    load_module(parts[0], path)


def parse_args(argv: Sequence[str]) -> RegressionConfig:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="TOML/YAML/JSON config file")
    args, overrides = parser.parse_known_args(list(argv))
    return load_config(args.config, overrides, cls=RegressionConfig)


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    """Train, export the weights, and return the last logged metrics."""
    config = parse_args(sys.argv[1:] if argv is None else argv)
    trainer = Trainer(
        config,
        model=ModuleProvider(
            lambda: MLP(config.model),
            parallelize_fn=shard,
            initial_weights=partial(load_weights, config.init_from) if config.init_from else None,
        ),
        data=DatasetProvider(
            lambda: RegressionDataset(config.data, config.model.num_features), collate_fn=collate
        ),
        task=RegressionTask(),
    )
    try:
        summary = trainer.fit()
        out = save_module(trainer.model_parts[0], config.export_to)  # collective: every rank calls it
        if trainer.topology.is_main:
            print(f"weights: {out}")
    finally:
        trainer.close()
    return summary


if __name__ == "__main__":
    main()
