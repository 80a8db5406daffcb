"""plait.models: transformer blocks, Qwen3 and Qwen3-MoE with Hugging Face parity and mappers, parallel plans."""

from plait.models.blocks import (
    AttentionMask,
    GroupedQueryAttention,
    LMHead,
    RMSNorm,
    RotaryEmbedding,
    SwiGLUMLP,
    TokenEmbedding,
    apply_rotary,
    build_attention_mask,
    document_ids_from_position_ids,
    pool_hidden_states,
    rope_inv_freq,
)
from plait.models.config import Qwen3Config, Qwen3MoeConfig, RopeParameters
from plait.models.flops import active_params, flops_per_token
from plait.models.hf import (
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
from plait.models.parallel import ActivationCheckpointing, ParallelConfig, parallelize
from plait.models.provider import Qwen3Provider
from plait.models.qwen3 import (
    Qwen3DecoderLayer,
    Qwen3ForCausalLM,
    Qwen3ForSequenceClassification,
    Qwen3Model,
    Qwen3Stage,
    stage_layer_ids,
)

__all__ = [
    "ActivationCheckpointing",
    "AttentionMask",
    "GroupedQueryAttention",
    "LMHead",
    "ParallelConfig",
    "Qwen3Config",
    "Qwen3DecoderLayer",
    "Qwen3ForCausalLM",
    "Qwen3ForSequenceClassification",
    "Qwen3Model",
    "Qwen3MoeConfig",
    "Qwen3Provider",
    "Qwen3Stage",
    "RMSNorm",
    "RopeParameters",
    "RotaryEmbedding",
    "SwiGLUMLP",
    "TokenEmbedding",
    "active_params",
    "apply_rotary",
    "build_attention_mask",
    "config_from_hf",
    "config_to_hf",
    "document_ids_from_position_ids",
    "flops_per_token",
    "from_pretrained",
    "hf_to_plait_mapper",
    "load_hf_checkpoint",
    "load_hf_config",
    "parallelize",
    "plait_to_hf_mapper",
    "pool_hidden_states",
    "rope_inv_freq",
    "save_hf_checkpoint",
    "save_hf_config",
    "stage_layer_ids",
]
