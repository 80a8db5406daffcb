"""Qwen3.5 (dense and MoE) and Qwen3-Next: hybrids of gated DeltaNet and gated full attention
(Hugging Face ``model_type`` ``qwen3_5_text``, ``qwen3_5_moe_text``, ``qwen3_next``, and the
vision-language ``qwen3_5`` / ``qwen3_5_moe`` checkpoints, of which plait builds the language model)."""

from plait.models.common.family import Family
from plait.models.qwen3_5.config import (
    LayerType,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
    Qwen3NextConfig,
    default_layer_types,
)
from plait.models.qwen3_5.flops import qwen3_5_flops_per_token
from plait.models.qwen3_5.hf import (
    SkipPrefixes,
    config_from_hf,
    config_to_hf,
    hf_module_names,
    hf_to_plait_mapper,
    plait_to_hf_mapper,
)
from plait.models.qwen3_5.model import Qwen3_5ForCausalLM, qwen3_5_layer
from plait.models.qwen3_5.parallel import tp_hybrid_layer

FAMILY = Family(
    name="qwen3_5",
    config_classes={
        "qwen3_5_text": Qwen3_5TextConfig,
        "qwen3_5": Qwen3_5TextConfig,
        "qwen3_5_moe_text": Qwen3_5MoeTextConfig,
        "qwen3_5_moe": Qwen3_5MoeTextConfig,
        "qwen3_next": Qwen3NextConfig,
    },
    config_from_hf=config_from_hf,
    config_to_hf=config_to_hf,
    causal_lm=Qwen3_5ForCausalLM,
    layer=qwen3_5_layer,
    hf_to_plait=hf_to_plait_mapper,
    plait_to_hf=plait_to_hf_mapper,
    tp_layer_plan=tp_hybrid_layer,
    flops_per_token=qwen3_5_flops_per_token,
    hf_module_names=hf_module_names,
)

__all__ = [
    "FAMILY",
    "LayerType",
    "Qwen3NextConfig",
    "Qwen3_5ForCausalLM",
    "Qwen3_5MoeTextConfig",
    "Qwen3_5TextConfig",
    "SkipPrefixes",
    "default_layer_types",
    "qwen3_5_flops_per_token",
    "qwen3_5_layer",
    "tp_hybrid_layer",
]
