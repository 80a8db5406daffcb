"""Llama 3 / 3.1 / 3.2 (Hugging Face ``model_type`` ``llama``)."""

from plait.models.common.family import Family
from plait.models.llama.config import LlamaConfig
from plait.models.llama.hf import config_from_hf, config_to_hf, hf_to_plait_mapper, plait_to_hf_mapper
from plait.models.llama.model import LlamaForCausalLM, llama_layer

FAMILY = Family(
    name="llama",
    config_classes={"llama": LlamaConfig},
    config_from_hf=config_from_hf,
    config_to_hf=config_to_hf,
    causal_lm=LlamaForCausalLM,
    layer=llama_layer,
    hf_to_plait=hf_to_plait_mapper,
    plait_to_hf=plait_to_hf_mapper,
)

__all__ = ["FAMILY", "LlamaConfig", "LlamaForCausalLM", "llama_layer"]
