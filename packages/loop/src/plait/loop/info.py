"""What is installed: plait's packages, the optional extras, the devices torch sees, and where to start.

Run it as ``plait info`` (or a bare ``plait``: the console script of the ``plait`` meta-package) or
``python -m plait.loop.info``.
"""

from __future__ import annotations

import importlib.metadata as metadata
import importlib.util
import os
import platform
import sys
from dataclasses import dataclass

__all__ = ["EXTRAS", "Extra", "InstallInfo", "collect", "main", "render"]


@dataclass(frozen=True)
class Extra:
    """An optional dependency: its import name, its distribution name and what it enables."""

    module: str
    distribution: str
    enables: str


EXTRAS: tuple[Extra, ...] = (
    Extra("triton", "triton", "Triton kernels (plait-kernels; CUDA, or TRITON_INTERPRET=1 on CPU)"),
    Extra("flash_attn", "flash-attn", "attn_implementation='flash' (pip install 'plait-models[flash]')"),
    Extra("deep_ep", "deep-ep", "expert_dispatch='deepep' (pip install 'plait-moe[deepep]')"),
    Extra("torchao", "torchao", "parallel.float8 training (pip install 'plait-models[float8]')"),
    Extra("aim", "aim", "the aim tracker (pip install 'plait-loop[aim]')"),
    Extra("tensorboard", "tensorboard", "the tensorboard tracker (pip install 'plait-loop[tensorboard]')"),
    Extra("wandb", "wandb", "the wandb tracker (pip install 'plait-loop[wandb]')"),
    Extra("matplotlib", "matplotlib", "loss curves and schedule plots (pip install 'plait-loop[viz]')"),
    Extra("tokenizers", "tokenizers", "Hugging Face tokenizers (pip install 'plait-loop[tokenizers]')"),
    Extra("pyarrow", "pyarrow", "Parquet data files"),
    Extra("datasets", "datasets", "Hugging Face datasets (pip install 'plait-loop[datasets]')"),
    Extra("jinja2", "jinja2", "chat templates"),
)

WHERE_TO_START = (
    "plait train                                  # the main job: a small Qwen3-MoE, CPU or CUDA",
    "plait train --data.source=FILE.jsonl         # your own data (one JSONL / parquet file or a folder)",
    "plait config                                 # every config key: type, default, meaning",
    "plait finetune --base runs/qwen3_moe/hf      # LoRA on its export",
    "uv run mkdocs serve                          # the documentation site (guides, API reference)",
    "packages/<name>/README.md                    # one README per package",
)


@dataclass(frozen=True)
class InstallInfo:
    """What :func:`collect` found."""

    python: str
    packages: dict[str, str]  # plait distribution -> version
    extras: dict[str, str | None]  # extra distribution -> version (None: missing)
    devices: list[str]


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def _devices() -> list[str]:
    import torch

    out = [f"cpu: {os.cpu_count()} cores, torch uses {torch.get_num_threads()} threads"]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            out.append(f"cuda:{i}: {props.name}, {props.total_memory / 1024**3:.0f} GiB")
    else:
        out.append("cuda: none visible")
    return out


def collect() -> InstallInfo:
    """Look at this environment: installed plait distributions, extras, torch and devices."""
    import torch

    packages = {"torch": torch.__version__, "pydantic": _version("pydantic") or "missing"}
    for dist in metadata.distributions():
        name = dist.metadata["Name"] or ""
        if name == "plait" or name.startswith("plait-"):
            packages[name] = dist.version
    extras = {}
    for extra in EXTRAS:
        found = importlib.util.find_spec(extra.module) is not None
        extras[extra.distribution] = (_version(extra.distribution) or "installed") if found else None
    return InstallInfo(
        python=f"{platform.python_version()} ({sys.executable})",
        packages=dict(sorted(packages.items())),
        extras=extras,
        devices=_devices(),
    )


def render(info: InstallInfo) -> str:
    """The text that ``plait`` prints."""
    lines = [f"python {info.python}", "", "packages:"]
    lines += [f"  {name:<20} {version}" for name, version in info.packages.items()]
    lines += ["", "optional extras:"]
    for extra in EXTRAS:
        version = info.extras.get(extra.distribution)
        state = f"{version}" if version is not None else "missing"
        lines.append(f"  {extra.distribution:<12} {state:<12} {extra.enables}")
    lines += ["", "devices:", *(f"  {d}" for d in info.devices), "", "where to start:"]
    lines += [f"  {line}" for line in WHERE_TO_START]
    return "\n".join(lines)


def main() -> None:
    """Print :func:`render` of :func:`collect`."""
    print(render(collect()))


if __name__ == "__main__":
    main()
