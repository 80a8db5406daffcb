"""DeepSeek-V3 (Hugging Face ``model_type`` ``deepseek_v3``)."""

from plait.models.common.family import Family
from plait.models.deepseek_v3.attention import ContextGather, MultiHeadLatentAttention, mla_softmax_scale
from plait.models.deepseek_v3.config import DeepseekV3Config
from plait.models.deepseek_v3.flops import deepseek_v3_flops_per_token
from plait.models.deepseek_v3.hf import (
    Duplicate,
    Fp8BlockDequantize,
    SkipLayersFrom,
    config_from_hf,
    config_to_hf,
    hf_to_plait_mapper,
    plait_to_hf_mapper,
)
from plait.models.deepseek_v3.model import (
    DeepseekV3ForCausalLM,
    MultiTokenPrediction,
    deepseek_v3_layer,
    deepseek_v3_router,
)
from plait.models.deepseek_v3.parallel import tp_mla_layer

FAMILY = Family(
    name="deepseek_v3",
    config_classes={"deepseek_v3": DeepseekV3Config},
    config_from_hf=config_from_hf,
    config_to_hf=config_to_hf,
    causal_lm=DeepseekV3ForCausalLM,
    layer=deepseek_v3_layer,
    hf_to_plait=hf_to_plait_mapper,
    plait_to_hf=plait_to_hf_mapper,
    tp_layer_plan=tp_mla_layer,
    flops_per_token=deepseek_v3_flops_per_token,
)

__all__ = [
    "FAMILY",
    "ContextGather",
    "DeepseekV3Config",
    "DeepseekV3ForCausalLM",
    "Duplicate",
    "Fp8BlockDequantize",
    "MultiHeadLatentAttention",
    "MultiTokenPrediction",
    "SkipLayersFrom",
    "deepseek_v3_flops_per_token",
    "deepseek_v3_layer",
    "deepseek_v3_router",
    "mla_softmax_scale",
    "tp_mla_layer",
]
