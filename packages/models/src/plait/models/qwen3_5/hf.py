"""Qwen3.5 / Qwen3-Next <-> Hugging Face: ``config.json`` and the checkpoint mapper graphs.

Key layouts:

* plait: Hugging Face names, except that every layer's token mixer sits in the decoder layer's
  ``self_attn`` slot (Hugging Face names a gated DeltaNet ``linear_attn``) and the MoE blocks keep
  plait.moe's names: ``mlp.router.weight`` ``[E, H]``, ``mlp.experts.gate_up_proj`` ``[E, 2I, H]``
  (gate rows first), ``mlp.experts.down_proj`` ``[E, H, I]``; ``mlp.shared_expert.*`` and
  ``mlp.shared_expert_gate.weight`` as in Hugging Face.
* Hugging Face on disk (``save_pretrained`` in transformers 5.x): ``model.layers.N.linear_attn.*``,
  ``mlp.gate.weight`` and per-expert ``mlp.experts.E.{gate,up,down}_proj.weight``; in memory the
  experts are fused like plait's (both are read).
* Qwen3.5's released checkpoints are the vision-language model (``qwen3_5`` / ``qwen3_5_moe``, the
  text model's config under ``text_config``): its language model is read from
  ``model.language_model.*`` (and ``lm_head.weight``); the vision tower (``model.visual.*``) and the
  multi-token-prediction module (``mtp.*``) are skipped with a logged note. The export is the text
  model (``qwen3_5_text`` / ``qwen3_5_moe_text``, ``model.*``), which transformers loads as
  ``Qwen3_5ForCausalLM`` / ``Qwen3_5MoeForCausalLM``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from plait.model_state import TensorSpec
from plait.model_state.mappers import (
    Concatenate,
    Drop,
    Mapper,
    MapperGroup,
    Parallel,
    Rename,
    Sequential,
    Stack,
)
from plait.models.common.config import DecoderConfig
from plait.models.common.family import ModuleNameMaps
from plait.models.common.hf.config import dump_hf_config, parse_hf_config
from plait.models.qwen3_5.config import (
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
    Qwen3NextConfig,
    _HybridConfig,
    default_layer_types,
)

__all__ = [
    "SkipPrefixes",
    "config_from_hf",
    "config_to_hf",
    "hf_module_names",
    "hf_to_plait_mapper",
    "plait_to_hf_mapper",
]

logger = logging.getLogger(__name__)

_CLASSES: dict[str, type[_HybridConfig]] = {
    "qwen3_5_text": Qwen3_5TextConfig,
    "qwen3_5_moe_text": Qwen3_5MoeTextConfig,
    "qwen3_next": Qwen3NextConfig,
}
_ARCH = {
    "qwen3_5_text": "Qwen3_5ForCausalLM",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
}
_VISION_LANGUAGE = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
# Keys of released configs that do not change the model plait builds (the MTP module is not built).
_IGNORED = ("mtp_num_hidden_layers", "mtp_use_dedicated_embeddings", "use_sliding_window", "sliding_window",
            "max_window_layers", "image_token_id", "video_token_id", "vision_start_token_id",
            "vision_end_token_id", "base_config_key")  # fmt: skip
_PLAIT_ONLY = {"router_aux_loss_pooling", "linear_attn_implementation", "linear_chunk_size", "mrope_section",
               "mrope_interleaved"}  # fmt: skip


def _text_config(d: dict[str, Any]) -> dict[str, Any]:
    """The language model's config of a vision-language ``config.json`` (the top-level
    ``tie_word_embeddings`` governs the head, as in transformers)."""
    text = d.get("text_config")
    if not isinstance(text, dict):
        raise ValueError(f"config.json of model_type {d['model_type']!r} has no text_config object")
    text = dict(text)
    text["model_type"] = _VISION_LANGUAGE[d["model_type"]]
    if "tie_word_embeddings" in d:
        text["tie_word_embeddings"] = d["tie_word_embeddings"]
    logger.info("config.json is the %s vision-language model: building its language model", d["model_type"])
    return text


def config_from_hf(d: dict[str, Any]) -> _HybridConfig:
    """The plait config of a Qwen3.5 / Qwen3.5-MoE (text or vision-language) or Qwen3-Next
    ``config.json`` dict (consumed).

    Raises:
        ValueError: naming an unsupported key or value.
    """
    if d.get("model_type") in _VISION_LANGUAGE:
        d = _text_config(d)
    cls = _CLASSES[str(d.get("model_type"))]
    if d.pop("attn_output_gate", True) is not True:
        raise ValueError(
            "config.json attn_output_gate=False is not supported (plait's full attention is gated)"
        )
    rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    for key in ("mrope_section", "mrope_interleaved"):
        if key in rope:
            d[key] = rope.pop(key)
    if "partial_rotary_factor" not in rope and "partial_rotary_factor" not in d:
        rope["partial_rotary_factor"] = 0.25  # transformers' default for these models
    d["rope_parameters" if "rope_parameters" in d or "rope_scaling" not in d else "rope_scaling"] = rope
    interval = d.pop("full_attention_interval", 4)
    if not d.get("layer_types"):
        n = d.get("num_hidden_layers", cls.model_fields["num_hidden_layers"].default)
        d["layer_types"] = list(default_layer_types(int(n), int(interval)))
    if cls is Qwen3_5MoeTextConfig:
        d.pop("intermediate_size", None)  # transformers' Qwen3.5-MoE has no dense layers
    return parse_hf_config(
        d,
        cls,
        ignored=_IGNORED,
        drop_none=("num_key_value_heads", "head_dim", "mlp_only_layers", "layer_types"),
    )


def config_to_hf(config: DecoderConfig) -> dict[str, Any]:
    """The ``config.json`` dict (transformers 5.x layout) of the text model."""
    assert isinstance(config, _HybridConfig)
    exclude = set(_PLAIT_ONLY)
    if isinstance(config, Qwen3_5MoeTextConfig):
        exclude |= {"intermediate_size", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers"}
    d = dump_hf_config(config, _ARCH[config.model_type], exclude=exclude)
    d["layer_types"] = list(config.layer_types)
    if "mlp_only_layers" in d:
        d["mlp_only_layers"] = list(d["mlp_only_layers"])
    rope = d["rope_parameters"]
    rope.setdefault("partial_rotary_factor", 1.0)  # transformers would default it to 0.25
    if config.mrope_section is not None:
        rope["mrope_section"] = list(config.mrope_section)
    if config.mrope_interleaved is not None:
        rope["mrope_interleaved"] = config.mrope_interleaved
    return d


class SkipPrefixes(Mapper):
    """Drops (never reads) the checkpoint keys under the given prefixes, logging one note per prefix
    that holds any (the parts of a checkpoint plait does not build).

    Args:
        prefixes: ``{prefix: what it holds}``, e.g. ``{"model.visual.": "the vision tower"}``.
    """

    def __init__(self, prefixes: Mapping[str, str]) -> None:
        self.prefixes = dict(prefixes)

    def groups(self, source: Mapping[str, TensorSpec]) -> list[MapperGroup]:
        out = []
        for prefix, what in self.prefixes.items():
            hit = [k for k in source if k.startswith(prefix)]
            if hit:
                logger.warning(
                    "skipping %d checkpoint tensors under %r (%s, which plait does not build or export)",
                    len(hit),
                    prefix,
                    what,
                )
                out.append(MapperGroup.drop(hit, repr(self)))
        return out

    def __repr__(self) -> str:
        return f"SkipPrefixes({list(self.prefixes)})"


_L = "model.layers.{i}.mlp"


def _mixer_rules(config: _HybridConfig) -> list[tuple[str, str]]:
    """Hugging Face's ``linear_attn`` -> plait's ``self_attn``, layer by layer (invertible)."""
    return [
        (f"model.layers.{i}.linear_attn.{{*p}}", f"model.layers.{i}.self_attn.{{*p}}")
        for i, kind in enumerate(config.layer_types)
        if kind == "linear_attention"
    ]


def _core(config: _HybridConfig) -> Mapper:
    """Text-model keys of Hugging Face's on-disk layout -> plait keys (invertible)."""
    return Sequential(
        Parallel(
            Rename([*_mixer_rules(config), (f"{_L}.gate.weight", f"{_L}.router.weight")]),
            Stack(f"{_L}.experts.{{e}}.gate_proj.weight", f"{_L}.experts._gate", over="e"),
            Stack(f"{_L}.experts.{{e}}.up_proj.weight", f"{_L}.experts._up", over="e"),
            Stack(f"{_L}.experts.{{e}}.down_proj.weight", f"{_L}.experts.down_proj", over="e"),
        ),
        Concatenate([f"{_L}.experts._gate", f"{_L}.experts._up"], f"{_L}.experts.gate_up_proj", dim=1),
    )


def hf_module_names(config: DecoderConfig) -> ModuleNameMaps:
    """``(plait module name -> transformers', the inverse)``: ``model.layers.N.self_attn[.*]`` <->
    ``model.layers.N.linear_attn[.*]`` on the gated DeltaNet layers (e.g. for PEFT adapters of
    their projections); every other name is the same."""
    assert isinstance(config, _HybridConfig)
    linear = {str(i) for i, kind in enumerate(config.layer_types) if kind == "linear_attention"}

    def rename(name: str, old: str, new: str) -> str:
        parts = name.split(".")
        if len(parts) > 3 and parts[:2] == ["model", "layers"] and parts[2] in linear and parts[3] == old:
            parts[3] = new
        return ".".join(parts)

    def to_hf(name: str) -> str:
        return rename(name, "self_attn", "linear_attn")

    def to_plait(name: str) -> str:
        return rename(name, "linear_attn", "self_attn")

    return to_hf, to_plait


def hf_to_plait_mapper(config: DecoderConfig) -> Mapper:
    """Mapper from a Hugging Face Qwen3.5 / Qwen3-Next checkpoint (text or vision-language, either
    expert layout) to plait keys; the vision tower and MTP weights are skipped (logged)."""
    assert isinstance(config, _HybridConfig)
    return Sequential(
        SkipPrefixes({"model.visual.": "the vision tower", "mtp.": "the multi-token-prediction module"}),
        Rename({"model.language_model.{*p}": "model.{*p}"}),
        _core(config),
    )


def plait_to_hf_mapper(config: DecoderConfig, *, fused_experts: bool = False) -> Mapper:
    """Mapper from plait keys to the Hugging Face text model's checkpoint.

    Args:
        config: The model config (tied embeddings drop ``lm_head.weight`` like ``save_pretrained``).
        fused_experts: Write transformers 5.x's in-memory fused expert tensors instead of the
            per-expert keys ``save_pretrained`` writes.
    """
    assert isinstance(config, _HybridConfig)
    rules = [(b, a) for a, b in _mixer_rules(config)]
    parts: list[Mapper] = [
        Rename([*rules, (f"{_L}.router.weight", f"{_L}.gate.weight")])
        if fused_experts
        else _core(config).inverse()
    ]
    if config.tie_word_embeddings:
        parts.append(Drop("lm_head.weight"))
    return parts[0] if len(parts) == 1 else Sequential(*parts)
