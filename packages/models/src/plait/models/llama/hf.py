"""Llama <-> Hugging Face: ``config.json`` and the checkpoint mappers (plait keeps HF's key names)."""

from __future__ import annotations

from typing import Any

from plait.model_state.mappers import Drop, Identity, Mapper
from plait.models.common.config import DecoderConfig
from plait.models.common.hf.config import dump_hf_config, parse_hf_config
from plait.models.llama.config import LlamaConfig

__all__ = ["config_from_hf", "config_to_hf", "hf_to_plait_mapper", "plait_to_hf_mapper"]


def config_from_hf(d: dict[str, Any]) -> LlamaConfig:
    """The plait config of a Llama ``config.json`` dict (consumed).

    Raises:
        ValueError: naming an unsupported key or value (e.g. ``rope_type="longrope"``).
    """
    return parse_hf_config(d, LlamaConfig)


def config_to_hf(config: DecoderConfig) -> dict[str, Any]:
    """The ``config.json`` dict (transformers 5.x layout) of a Llama config."""
    return dump_hf_config(config, "LlamaForCausalLM")


def hf_to_plait_mapper(config: DecoderConfig | None = None) -> Mapper:
    """Hugging Face Llama keys -> plait keys: the same names (``model.layers.N.self_attn.q_proj.weight``...)."""
    del config
    return Identity()


def plait_to_hf_mapper(config: DecoderConfig, *, fused_experts: bool = False) -> Mapper:
    """plait keys -> Hugging Face Llama keys (tied embeddings drop ``lm_head.weight``, as
    ``save_pretrained`` does). ``fused_experts`` is accepted for the common signature (no experts)."""
    del fused_experts
    return Drop("lm_head.weight") if config.tie_word_embeddings else Identity()
