"""``config.json`` (Hugging Face) <-> plait config: the parsing every family shares."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from plait.models.common.config import DecoderConfig, RopeParameters
from pydantic import ValidationError

__all__ = ["config_dict", "dump_hf_config", "parse_hf_config", "read_config_json", "rope_from_hf"]

C = TypeVar("C", bound=DecoderConfig)

# HF keys no family models: accepted on read, ignored (no effect on the forward pass).
IGNORED = frozenset(
    {
        "architectures",
        "dtype",
        "torch_dtype",
        "transformers_version",
        "use_cache",
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
        "pretraining_tp",
    }
)


def rope_from_hf(d: dict[str, Any]) -> RopeParameters:
    """Pop the RoPE keys of a ``config.json`` dict (transformers 5.x ``rope_parameters`` or 4.x
    ``rope_theta`` + ``rope_scaling``) and return them as :class:`RopeParameters`.

    Raises:
        ValueError: naming the unsupported ``rope_type`` or key.
    """
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
    except ValidationError as e:
        raise ValueError(f"config.json rope_parameters {merged!r} not supported: {_first_error(e)}") from None


def _first_error(e: ValidationError) -> str:
    err = e.errors()[0]
    loc = ".".join(str(x) for x in err["loc"])
    return f"{loc}: {err['msg']}" if loc else err["msg"]


def _changes_numerics(key: str) -> bool:
    return key.endswith(("_size", "_dim", "_layers", "_heads", "_experts", "_rank")) or key.startswith("num_")


def config_dict(hf: Mapping[str, Any] | Any) -> dict[str, Any]:
    """A mutable copy of a ``config.json`` dict or a transformers ``PretrainedConfig``."""
    return dict(hf if isinstance(hf, Mapping) else hf.to_dict())


def parse_hf_config(
    d: dict[str, Any],
    cls: type[C],
    *,
    ignored: Iterable[str] = (),
    drop_none: Iterable[str] = ("num_key_value_heads", "head_dim"),
) -> C:
    """Build ``cls`` from a ``config.json`` dict whose RoPE keys are still in it.

    Keys that ``cls`` has are passed on; HF metadata without effect on the model is ignored; a key
    that looks like an architecture field (``*_size``, ``num_*``, ...) and that ``cls`` does not
    know is an error, as is a value ``cls`` refuses.

    Args:
        d: The dict (consumed).
        cls: The family's config class.
        ignored: More keys this family reads elsewhere or knows to be without effect.
        drop_none: Keys whose ``None`` means "the default" (dropped so the default applies).

    Raises:
        ValueError: naming the key (and value) that is not supported.
    """
    d["rope_parameters"] = rope_from_hf(d)
    skip = IGNORED | set(ignored)
    fields = set(cls.model_fields)
    kwargs: dict[str, Any] = {}
    for key, value in d.items():
        if key in fields and key != "model_type":
            kwargs[key] = value
        elif key not in skip and not key.startswith("_") and _changes_numerics(key):
            raise ValueError(f"config.json key {key!r} is not supported by plait's {cls.__name__}")
    for key in drop_none:
        if kwargs.get(key) is None:
            kwargs.pop(key, None)
    try:
        return cls(**kwargs)
    except ValidationError as e:
        raise ValueError(f"config.json: {_first_error(e)} (plait's {cls.__name__})") from None


def dump_hf_config(config: DecoderConfig, architecture: str, exclude: Iterable[str] = ()) -> dict[str, Any]:
    """The ``config.json`` dict (transformers 5.x layout) of the fields every family shares;
    ``exclude`` names plait-only fields of the family."""
    d = config.model_dump(exclude={"attn_implementation", *exclude})
    d["num_key_value_heads"] = config.kv_heads
    d["head_dim"] = config.resolved_head_dim
    rope = config.rope_parameters.model_dump(exclude_none=True)
    if rope.get("truncate", True) and config.rope_parameters.rope_type != "yarn":
        rope.pop("truncate", None)
    if rope.get("partial_rotary_factor") == 1.0:
        rope.pop("partial_rotary_factor")
    d["rope_parameters"] = rope
    d["architectures"] = [architecture]
    return d


def read_config_json(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``config.json`` of a checkpoint directory (or the file itself) as a dict."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.exists():
        raise FileNotFoundError(f"no config.json at {p}")
    try:
        out = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{p}: not valid JSON ({e})") from None
    if not isinstance(out, dict):
        raise ValueError(f"{p}: expected a JSON object")
    return out
