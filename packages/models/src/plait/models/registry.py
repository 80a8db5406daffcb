"""The model families, by Hugging Face ``model_type``: the one place outside a family's folder that
names families. Adding a family is adding its folder (with a ``FAMILY`` record) and its entries here.
"""

from __future__ import annotations

import importlib

from plait.models.common.config import DecoderConfig
from plait.models.common.family import Family

__all__ = ["family_for", "family_of", "supported_model_types"]

# Hugging Face model_type -> the package of the family that implements it (imported when first used).
_FAMILIES: dict[str, str] = {
    "qwen3": "plait.models.qwen3",
    "qwen3_moe": "plait.models.qwen3",
    "llama": "plait.models.llama",
    "gpt_oss": "plait.models.gpt_oss",
    "deepseek_v3": "plait.models.deepseek_v3",
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
