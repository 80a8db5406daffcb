"""Hugging Face entry points for every family: ``config.json``, checkpoint mappers, load and export.

Each function picks the family from ``model_type`` (:mod:`plait.models.registry`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from plait.model_state import Mapper
from plait.models.common import model as _model
from plait.models.common.config import DecoderConfig
from plait.models.common.family import ModuleNameMaps
from plait.models.common.hf.config import config_dict, read_config_json
from plait.models.common.hf.io import load_checkpoint, save_checkpoint
from plait.models.common.model import CausalLMStage, DecoderStage
from plait.models.registry import family_for, family_of
from torch import nn

__all__ = [
    "build_causal_lm",
    "check_fits",
    "config_from_hf",
    "config_to_hf",
    "estimate_num_parameters",
    "from_pretrained",
    "hf_module_names",
    "hf_to_plait_mapper",
    "load_hf_checkpoint",
    "load_hf_config",
    "plait_to_hf_mapper",
    "save_hf_checkpoint",
    "save_hf_config",
]


def config_from_hf(hf: Mapping[str, Any] | Any) -> DecoderConfig:
    """Build the family's plait config from a Hugging Face config dict (``config.json``) or
    ``PretrainedConfig``; transformers 5.x (``rope_parameters``) and 4.x (``rope_theta`` +
    ``rope_scaling``) layouts are both read.

    Raises:
        ValueError: an unsupported ``model_type`` (the supported ones are listed), key or value.
    """
    d = config_dict(hf)
    return family_for(d.get("model_type")).config_from_hf(d)


def config_to_hf(config: DecoderConfig) -> dict[str, Any]:
    """The ``config.json`` dict (transformers 5.x layout) of a plait config."""
    return family_of(config).config_to_hf(config)


def load_hf_config(path: str | os.PathLike[str]) -> DecoderConfig:
    """Read ``config.json`` from a checkpoint directory (or the file itself)."""
    return config_from_hf(read_config_json(path))


def save_hf_config(config: DecoderConfig, directory: str | Path) -> Path:
    """Write ``config.json`` into ``directory``; returns its path."""
    out = Path(directory) / "config.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(config_to_hf(config), indent=2, sort_keys=True) + "\n")
    return out


def hf_to_plait_mapper(config: DecoderConfig) -> Mapper:
    """The mapper from the family's Hugging Face checkpoint keys to plait module keys."""
    return family_of(config).hf_to_plait(config)


def plait_to_hf_mapper(config: DecoderConfig, *, fused_experts: bool = False) -> Mapper:
    """The mapper from plait module keys to the family's Hugging Face checkpoint keys.

    Args:
        config: The model config.
        fused_experts: MoE families: write transformers 5.x's in-memory fused expert tensors instead
            of the per-expert keys ``save_pretrained`` writes.
    """
    return family_of(config).plait_to_hf(config, fused_experts=fused_experts)


def _same(name: str) -> str:
    return name


def hf_module_names(config: DecoderConfig) -> ModuleNameMaps:
    """``(plait module name -> transformers module name, transformers -> plait)``: the ``name_map``
    arguments of :func:`plait.peft.hf.export_hf_adapter` and :func:`plait.peft.hf.import_hf_adapter`
    (identities for families whose module names are transformers' own, e.g. not Qwen3.5's gated
    DeltaNet layers, which plait keeps in the ``self_attn`` slot and transformers names ``linear_attn``)."""
    names = family_of(config).hf_module_names
    return names(config) if names is not None else (_same, _same)


def build_causal_lm(config: DecoderConfig, *, stage_index: int = 0, num_stages: int = 1) -> CausalLMStage:
    """The family's causal LM (or stage ``stage_index`` of ``num_stages``), built where the current
    device context says (use ``torch.device("meta")`` for large models)."""
    return family_of(config).causal_lm(config, stage_index=stage_index, num_stages=num_stages)


def estimate_num_parameters(config: DecoderConfig) -> int:
    """Parameters of the whole model of ``config``, counted without allocating any."""
    return _model.estimate_num_parameters(config, family_of(config).layer)


def _memory_of(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[1])
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def check_fits(
    config: DecoderConfig, device: torch.device | str, dtype: torch.dtype, shards: int = 1
) -> None:
    """Refuse, before anything is built, a model whose parameters alone, split evenly over ``shards``
    ranks (pipeline stages, FSDP: the best case), exceed the memory of one ``device``.

    Raises:
        ValueError: naming the estimate, the device's memory and the config's size fields.
    """
    dev = torch.device(device)
    if dev.type not in ("cpu", "cuda"):
        return
    n = estimate_num_parameters(config)
    need = n * torch.empty((), dtype=dtype).element_size() // max(shards, 1)
    have = _memory_of(dev)
    if need > have:
        sizes = ", ".join(
            f"{k}={v}"
            for k, v in config.model_dump().items()
            if isinstance(v, int)
            and not isinstance(v, bool)
            and (k.endswith("_size") or k.startswith("num_"))
        )
        raise ValueError(
            f"the model of this config has {n:.3e} parameters: {need / 2**30:,.1f} GiB in {dtype} "
            f"(split over {shards} rank(s)), more than the {have / 2**30:,.1f} GiB of {dev}. Check its sizes: {sizes}"
        )


def _config_of(modules: nn.Module | Sequence[nn.Module]) -> DecoderConfig:
    first = modules if isinstance(modules, nn.Module) else modules[0]
    if not isinstance(first, DecoderStage):
        raise TypeError(f"{type(first).__name__} is not a plait decoder stage (no family config)")
    return first.config


def load_hf_checkpoint(
    modules: nn.Module | Sequence[nn.Module],
    path: str | os.PathLike[str],
    *,
    allow_cast: bool = True,
    device: torch.device | str | None = None,
) -> int:
    """Load a Hugging Face checkpoint directory into plait stage module(s), in place.

    Works on plain, meta-device, FSDP2, tensor-parallel, expert-parallel and pipeline-stage modules:
    every rank reads only the bytes of the shards it holds. Checkpoint keys of other stages are
    skipped unread.

    Args:
        modules: One stage module or all stages this rank holds.
        path: Checkpoint directory (``model.safetensors`` or sharded with an index).
        allow_cast: Cast checkpoint dtypes to the module's parameter dtypes (e.g. bf16 -> fp32).
        device: Where to materialise meta modules.

    Returns:
        Bytes read by this process.

    Raises:
        KeyError: the checkpoint lacks parameters the module(s) need (listed).
    """
    mapper = hf_to_plait_mapper(_config_of(modules))
    return load_checkpoint(modules, path, mapper, allow_cast=allow_cast, device=device)


def save_hf_checkpoint(
    modules: nn.Module | Sequence[nn.Module],
    out_dir: str | os.PathLike[str],
    *,
    fused_experts: bool = False,
    is_writer: bool | None = None,
    group: dist.ProcessGroup | None = None,
    max_shard_size: int | str = "5GB",
) -> Path:
    """Export plait stage module(s) as a Hugging Face checkpoint (safetensors + ``config.json``).

    Collective when torch.distributed is initialised: every rank calls it with its local stages
    (DTensors are gathered group by group). ``is_writer`` marks the ranks that write their stages'
    keys: by default the first rank of ``group``; with pipeline parallelism pass True on one rank
    per stage (e.g. the data-parallel rank 0 of each stage). ``config.json`` is written by the
    first rank of ``group``.

    Args:
        modules: Stage module(s) on this rank.
        out_dir: Output directory (its shards, index and ``config.json`` are replaced; other files stay).
        fused_experts: MoE families: write transformers 5.x fused expert tensors instead of per-expert keys.
        is_writer: Whether this rank writes its keys.
        group: Process group of the save (default: world).
        max_shard_size: Per-file size bound.

    Returns:
        The checkpoint directory.
    """
    config = _config_of(modules)
    mapper = plait_to_hf_mapper(config, fused_experts=fused_experts)
    return save_checkpoint(
        modules,
        out_dir,
        mapper,
        config_to_hf(config),
        is_writer=is_writer,
        group=group,
        max_shard_size=max_shard_size,
    )


def from_pretrained(
    path: str | os.PathLike[str],
    *,
    stage_index: int = 0,
    num_stages: int = 1,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    **config_overrides: Any,
) -> CausalLMStage:
    """Build the family's causal LM (stage) from a Hugging Face checkpoint directory.

    The family comes from ``config.json``'s ``model_type``. For sharded models build on meta
    (:func:`build_causal_lm`), :func:`plait.models.parallelize`, then :func:`load_hf_checkpoint`.

    A model whose parameters alone exceed the device's memory is refused before anything is
    allocated (:func:`check_fits`).

    Args:
        path: Checkpoint directory with ``config.json``.
        stage_index: Pipeline stage to build.
        num_stages: Number of pipeline stages.
        device: Target device.
        dtype: Parameter dtype (default: fp32).
        **config_overrides: plait config fields to override (e.g. ``attn_implementation``).
    """
    config = load_hf_config(path)
    if config_overrides:
        config = type(config)(**{**config.model_dump(), **config_overrides})
    check_fits(config, device, dtype or torch.float32, num_stages)
    with torch.device("meta"):
        model = build_causal_lm(config, stage_index=stage_index, num_stages=num_stages)
    if dtype is not None:
        model.to(dtype)
    load_hf_checkpoint(model, path, device=device)
    return model
