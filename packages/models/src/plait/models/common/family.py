"""What a model family gives the generic entry points (one record per family, in its folder)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from plait.model_state import Mapper
from plait.models.common.config import DecoderConfig
from plait.models.common.flops import gqa_decoder_flops_per_token
from plait.models.common.model import CausalLMStage, LayerFactory
from plait.models.common.parallel.plan import LayerTensorParallel, tp_gqa_layer

__all__ = ["Family", "ModuleNameMaps"]

# (plait module name -> transformers module name, transformers -> plait)
ModuleNameMaps = tuple[Callable[[str], str], Callable[[str], str]]


@dataclass(frozen=True)
class Family:
    """A model family: how to read and write its Hugging Face configs and checkpoints, build it,
    shard it and count its FLOPs. Registered under its ``model_type`` values in
    :mod:`plait.models.registry`.

    Attributes:
        name: The family's folder name.
        config_classes: The family's config class per ``model_type`` it implements.
        config_from_hf: ``config.json`` dict (consumed) -> the family's config; raises ``ValueError``
            naming an unsupported key or value.
        config_to_hf: The family's config -> ``config.json`` dict.
        causal_lm: ``(config, *, stage_index, num_stages) -> stage`` (the family's causal-LM class).
        layer: The family's decoder layer factory (``(config, layer_idx) -> DecoderLayer``).
        hf_to_plait: ``config -> mapper`` from Hugging Face keys to plait's.
        plait_to_hf: ``(config, *, fused_experts) -> mapper`` from plait keys to Hugging Face's.
        tp_layer_plan: Tensor-parallel plan of one decoder layer.
        flops_per_token: ``(config, seq_len) -> training FLOPs per token``.
        hf_module_names: ``config -> (plait module name -> transformers module name, the inverse)``
            where the family's module names differ from transformers' (None: the same names).
    """

    name: str
    config_classes: Mapping[str, type[DecoderConfig]]
    config_from_hf: Callable[[dict[str, Any]], DecoderConfig]
    config_to_hf: Callable[[DecoderConfig], dict[str, Any]]
    causal_lm: Callable[..., CausalLMStage]
    layer: LayerFactory
    hf_to_plait: Callable[[DecoderConfig], Mapper]
    plait_to_hf: Callable[..., Mapper]
    tp_layer_plan: LayerTensorParallel = tp_gqa_layer
    flops_per_token: Callable[[DecoderConfig, int], float] = gqa_decoder_flops_per_token
    hf_module_names: Callable[[DecoderConfig], ModuleNameMaps] | None = None
