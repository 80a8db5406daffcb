"""``config.json`` (Hugging Face) <-> plait config."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from plait.models.config import Qwen3Config, Qwen3MoeConfig, RopeParameters

__all__ = ["config_from_hf", "config_to_hf", "load_hf_config", "save_hf_config"]

# HF keys plait does not model: accepted on read, ignored (no effect on the forward pass).
_IGNORED = {
    "architectures",
    "dtype",
    "torch_dtype",
    "transformers_version",
    "use_cache",
    "sliding_window",
    "max_window_layers",
    "layer_types",
    "_name_or_path",
    "_attn_implementation_autoset",
    "output_attentions",
    "output_hidden_states",
    "return_dict",
    "tie_encoder_decoder",
    "chunk_size_feed_forward",
    "is_encoder_decoder",
    "id2label",
    "label2id",
    "problem_type",
    "pruned_heads",
    "model_type",
    "num_labels",
}
_ARCH = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}


def _rope_from_hf(d: dict[str, Any]) -> RopeParameters:
    params = d.pop("rope_parameters", None)
    legacy_scaling = d.pop("rope_scaling", None)  # transformers 4.x
    theta = d.pop("rope_theta", None)
    partial = d.pop("partial_rotary_factor", None)
    merged: dict[str, Any] = {}
    for src in (legacy_scaling, params):
        if src:
            merged.update(src)
    if "type" in merged and "rope_type" not in merged:
        merged["rope_type"] = merged.pop("type")
    merged.pop("type", None)
    if theta is not None:
        merged.setdefault("rope_theta", theta)
    if partial is not None:
        merged.setdefault("partial_rotary_factor", partial)
    try:
        return RopeParameters(**merged)
    except Exception as e:
        raise ValueError(f"config.json rope_parameters {merged!r} not supported: {e}") from e


def _changes_numerics(key: str) -> bool:
    return key.endswith(("_size", "_dim", "_layers", "_heads", "_experts")) or key.startswith("num_")


def config_from_hf(hf: dict[str, Any] | Any) -> Qwen3Config:
    """Build a plait config from a Hugging Face config dict (``config.json``) or ``PretrainedConfig``.

    Accepts both transformers 5.x (``rope_parameters``) and 4.x (``rope_theta`` + ``rope_scaling``)
    layouts and ``num_local_experts`` as an alias of ``num_experts``.

    Raises:
        ValueError: naming the unsupported ``model_type`` or key.
    """
    d = dict(hf if isinstance(hf, dict) else hf.to_dict())
    model_type = d.get("model_type")
    if model_type not in _ARCH:
        raise ValueError(f"config.json model_type must be one of {sorted(_ARCH)}, got {model_type!r}")
    if "num_local_experts" in d:
        d.setdefault("num_experts", d.pop("num_local_experts"))
        d.pop("num_local_experts", None)
    d["rope_parameters"] = _rope_from_hf(d)
    cls = Qwen3MoeConfig if model_type == "qwen3_moe" else Qwen3Config
    fields = set(cls.model_fields)
    kwargs: dict[str, Any] = {}
    for key, value in d.items():
        if key in fields and key != "model_type":
            kwargs[key] = value
        elif key not in _IGNORED and not key.startswith("_") and _changes_numerics(key):
            # Generation / tokenizer metadata without effect on the model is common in
            # config.json and ignored; keys that look like architecture fields are an error.
            raise ValueError(f"config.json key {key!r} is not supported by plait's {cls.__name__}")
    if kwargs.get("mlp_only_layers") is None:
        kwargs.pop("mlp_only_layers", None)
    if kwargs.get("num_key_value_heads") is None:
        kwargs.pop("num_key_value_heads", None)
    return cls(**kwargs)


def config_to_hf(config: Qwen3Config) -> dict[str, Any]:
    """The ``config.json`` dict (transformers 5.x layout) for a plait config."""
    d = config.model_dump(exclude={"attn_implementation", "router_aux_loss_pooling"})
    d["num_key_value_heads"] = config.kv_heads
    d["head_dim"] = config.resolved_head_dim
    rope = config.rope_parameters.model_dump(exclude_none=True)
    if rope.get("truncate", True) and config.rope_parameters.rope_type != "yarn":
        rope.pop("truncate", None)
    if rope.get("partial_rotary_factor") == 1.0:
        rope.pop("partial_rotary_factor")
    d["rope_parameters"] = rope
    if isinstance(config, Qwen3MoeConfig):
        d["mlp_only_layers"] = list(config.mlp_only_layers)
    d["architectures"] = [_ARCH[config.model_type]]
    d["use_sliding_window"] = False
    d["sliding_window"] = None
    return d


def load_hf_config(path: str | os.PathLike[str]) -> Qwen3Config:
    """Read ``config.json`` from a checkpoint directory (or the file itself)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.exists():
        raise FileNotFoundError(f"no config.json at {p}")
    return config_from_hf(json.loads(p.read_text()))


def save_hf_config(config: Qwen3Config, directory: str | Path) -> Path:
    """Write ``config.json`` into ``directory``; returns its path."""
    out = Path(directory) / "config.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(config_to_hf(config), indent=2, sort_keys=True) + "\n")
    return out
