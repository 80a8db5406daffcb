"""plait.models: decoder families on one trunk (``common``), picked by Hugging Face ``model_type``.

The generic entry points (:func:`from_pretrained`, :func:`load_hf_config`, the mappers,
:func:`parallelize`, :func:`flops_per_token`, :class:`CausalLMProvider`) dispatch on the family;
the families' own classes live in their folders (``plait.models.qwen3``, ``plait.models.llama``,
``plait.models.gpt_oss``).
"""

from plait.models.common import (
    AttentionMask,
    CausalLMStage,
    ContextParallel,
    DecoderConfig,
    DecoderLayer,
    DecoderStage,
    Family,
    GroupedQueryAttention,
    LMHead,
    RMSNorm,
    RopeParameters,
    RotaryEmbedding,
    SequenceClassifierStage,
    SwiGLUMLP,
    TokenEmbedding,
    apply_rotary,
    build_attention_mask,
    document_ids_from_position_ids,
    pool_hidden_states,
    rope_inv_freq,
    stage_layer_ids,
)
from plait.models.common.parallel import ActivationCheckpointing, ParallelConfig, apply_context_parallel
from plait.models.flops import flops_per_token
from plait.models.hf import (
    build_causal_lm,
    config_from_hf,
    config_to_hf,
    from_pretrained,
    hf_to_plait_mapper,
    load_hf_checkpoint,
    load_hf_config,
    plait_to_hf_mapper,
    save_hf_checkpoint,
    save_hf_config,
)
from plait.models.plan import parallelize
from plait.models.provider import CausalLMProvider
from plait.models.registry import config_class_for, family_for, family_of, parse_config, supported_model_types

__all__ = [
    "ActivationCheckpointing",
    "AttentionMask",
    "CausalLMProvider",
    "CausalLMStage",
    "ContextParallel",
    "DecoderConfig",
    "DecoderLayer",
    "DecoderStage",
    "Family",
    "GroupedQueryAttention",
    "LMHead",
    "ParallelConfig",
    "RMSNorm",
    "RopeParameters",
    "RotaryEmbedding",
    "SequenceClassifierStage",
    "SwiGLUMLP",
    "TokenEmbedding",
    "apply_context_parallel",
    "apply_rotary",
    "build_attention_mask",
    "build_causal_lm",
    "config_class_for",
    "config_from_hf",
    "config_to_hf",
    "document_ids_from_position_ids",
    "family_for",
    "family_of",
    "flops_per_token",
    "from_pretrained",
    "hf_to_plait_mapper",
    "load_hf_checkpoint",
    "load_hf_config",
    "parallelize",
    "parse_config",
    "plait_to_hf_mapper",
    "pool_hidden_states",
    "rope_inv_freq",
    "save_hf_checkpoint",
    "save_hf_config",
    "stage_layer_ids",
    "supported_model_types",
]
