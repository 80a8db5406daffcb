"""The model families, by Hugging Face ``model_type``: the one place outside a family's folder that
names families. Adding a family is adding its folder (with a ``FAMILY`` record) and its entries here.
"""

from __future__ import annotations

import importlib

from plait.models.common.config import DecoderConfig
from plait.models.common.family import Family

__all__ = ["config_class_for", "family_for", "family_of", "parse_config", "supported_model_types"]

# Hugging Face model_type -> the package of the family that implements it (imported when first used).
_FAMILIES: dict[str, str] = {
    "qwen3": "plait.models.qwen3",
    "qwen3_moe": "plait.models.qwen3",
    "llama": "plait.models.llama",
    "gpt_oss": "plait.models.gpt_oss",
    "deepseek_v3": "plait.models.deepseek_v3",
    "qwen3_5_text": "plait.models.qwen3_5",
    "qwen3_5_moe_text": "plait.models.qwen3_5",
    "qwen3_5": "plait.models.qwen3_5",
    "qwen3_5_moe": "plait.models.qwen3_5",
    "qwen3_next": "plait.models.qwen3_5",
}


def supported_model_types() -> list[str]:
    """The Hugging Face ``model_type`` values plait implements, sorted."""
    return sorted(_FAMILIES)


def family_for(model_type: object) -> Family:
    """The family registered under ``model_type``.

    Raises:
        ValueError: ``model_type`` is not registered (the message lists the supported ones).
    """
    if not isinstance(model_type, str) or model_type not in _FAMILIES:
        raise ValueError(
            f"config.json model_type must be one of {supported_model_types()}, got {model_type!r}"
        )
    family: Family = importlib.import_module(_FAMILIES[model_type]).FAMILY
    return family


def family_of(config: DecoderConfig) -> Family:
    """The family of a plait config (by its ``model_type``)."""
    return family_for(config.model_type)


def config_class_for(model_type: object) -> type[DecoderConfig]:
    """The plait config class of ``model_type`` (e.g. for a ``[model]`` section of a run config)."""
    family = family_for(model_type)  # raises unless model_type is a registered string
    return family.config_classes[str(model_type)]


def parse_config(data: dict[str, object]) -> DecoderConfig:
    """Validate a plait config dict (field names as in ``config.json``; unknown keys are errors)
    with the class of its ``model_type``.

    Raises:
        ValueError: an unsupported ``model_type``; pydantic's ``ValidationError`` for bad fields.
    """
    return config_class_for(data.get("model_type")).model_validate(data)
