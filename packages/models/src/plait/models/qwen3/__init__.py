"""Qwen3 and Qwen3-MoE (Hugging Face ``model_type`` ``qwen3`` and ``qwen3_moe``)."""

from plait.models.common.family import Family
from plait.models.qwen3.config import Qwen3Config, Qwen3MoeConfig
from plait.models.qwen3.hf import config_from_hf, config_to_hf, hf_to_plait_mapper, plait_to_hf_mapper
from plait.models.qwen3.model import Qwen3ForCausalLM, Qwen3ForSequenceClassification, qwen3_layer

FAMILY = Family(
    name="qwen3",
    config_classes={"qwen3": Qwen3Config, "qwen3_moe": Qwen3MoeConfig},
    config_from_hf=config_from_hf,
    config_to_hf=config_to_hf,
    causal_lm=Qwen3ForCausalLM,
    layer=qwen3_layer,
    hf_to_plait=hf_to_plait_mapper,
    plait_to_hf=plait_to_hf_mapper,
)

__all__ = [
    "FAMILY",
    "Qwen3Config",
    "Qwen3ForCausalLM",
    "Qwen3ForSequenceClassification",
    "Qwen3MoeConfig",
    "qwen3_layer",
]
