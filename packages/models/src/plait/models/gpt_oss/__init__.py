"""gpt-oss (Hugging Face ``model_type`` ``gpt_oss``)."""

from plait.models.common.family import Family
from plait.models.gpt_oss.config import GptOssConfig
from plait.models.gpt_oss.hf import config_from_hf, config_to_hf, hf_to_plait_mapper, plait_to_hf_mapper
from plait.models.gpt_oss.model import GptOssForCausalLM, gpt_oss_layer

FAMILY = Family(
    name="gpt_oss",
    config_classes={"gpt_oss": GptOssConfig},
    config_from_hf=config_from_hf,
    config_to_hf=config_to_hf,
    causal_lm=GptOssForCausalLM,
    layer=gpt_oss_layer,
    hf_to_plait=hf_to_plait_mapper,
    plait_to_hf=plait_to_hf_mapper,
)

__all__ = ["FAMILY", "GptOssConfig", "GptOssForCausalLM", "gpt_oss_layer"]
