"""Qwen3 / Qwen3-MoE <-> Hugging Face: ``config.json`` and the checkpoint mapper graphs.

Key layouts:

* plait: HF names everywhere except the MoE block, which keeps plait.moe's names:
  ``model.layers.N.mlp.router.weight`` ``[E, H]``, ``model.layers.N.mlp.experts.gate_up_proj``
  ``[E, 2I, H]`` (gate rows first), ``model.layers.N.mlp.experts.down_proj`` ``[E, H, I]``.
* HF on disk (what ``save_pretrained`` writes in transformers 5.x, and every hub checkpoint):
  ``model.layers.N.mlp.gate.weight`` and per-expert
  ``model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight``.
* HF in memory (transformers 5.x ``Qwen3MoeExperts``): fused ``mlp.experts.gate_up_proj`` /
  ``mlp.experts.down_proj`` -- identical to plait's, so they pass through.
"""

from __future__ import annotations

from typing import Any

from plait.model_state.mappers import (
    Concatenate,
    Drop,
    Mapper,
    Parallel,
    Rename,
    Sequential,
    Stack,
)
from plait.models.common.config import DecoderConfig
from plait.models.common.hf.config import dump_hf_config, parse_hf_config
from plait.models.qwen3.config import Qwen3Config, Qwen3MoeConfig

__all__ = ["config_from_hf", "config_to_hf", "hf_to_plait_mapper", "plait_to_hf_mapper"]

_ARCH = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
# Window keys that only matter with use_sliding_window=True, which the config refuses.
_IGNORED = ("sliding_window", "max_window_layers", "layer_types")


def config_from_hf(d: dict[str, Any]) -> Qwen3Config:
    """The plait config of a Qwen3 / Qwen3-MoE ``config.json`` dict (consumed); ``num_local_experts``
    is an alias of ``num_experts``.

    Raises:
        ValueError: naming an unsupported key or value.
    """
    if "num_local_experts" in d:
        d.setdefault("num_experts", d.pop("num_local_experts"))
        d.pop("num_local_experts", None)
    cls = Qwen3MoeConfig if d.get("model_type") == "qwen3_moe" else Qwen3Config
    return parse_hf_config(
        d, cls, ignored=_IGNORED, drop_none=("num_key_value_heads", "head_dim", "mlp_only_layers")
    )


def config_to_hf(config: DecoderConfig) -> dict[str, Any]:
    """The ``config.json`` dict (transformers 5.x layout) of a Qwen3 / Qwen3-MoE config."""
    assert isinstance(config, Qwen3Config)
    d = dump_hf_config(config, _ARCH[config.model_type], exclude={"router_aux_loss_pooling"})
    if isinstance(config, Qwen3MoeConfig):
        d["mlp_only_layers"] = list(config.mlp_only_layers)
    d["use_sliding_window"] = False
    d["sliding_window"] = None
    return d


_L = "model.layers.{i}.mlp"


def hf_to_plait_mapper(config: DecoderConfig | None = None) -> Mapper:
    """Mapper from a Hugging Face Qwen3 / Qwen3-MoE checkpoint (either expert layout) to plait keys.

    Per-expert keys are stacked (``gate``/``up`` then concatenated into ``gate_up_proj``); fused
    keys and every dense key pass through; the router is renamed. Expert-parallel loading reads
    only the experts a rank owns (the stack's slicer skips the others).

    Args:
        config: Unused for the key mapping (kept for symmetry with :func:`plait_to_hf_mapper`).
    """
    del config
    return Sequential(
        Parallel(
            Rename({f"{_L}.gate.weight": f"{_L}.router.weight"}),
            Stack(f"{_L}.experts.{{e}}.gate_proj.weight", f"{_L}.experts._gate", over="e"),
            Stack(f"{_L}.experts.{{e}}.up_proj.weight", f"{_L}.experts._up", over="e"),
            Stack(f"{_L}.experts.{{e}}.down_proj.weight", f"{_L}.experts.down_proj", over="e"),
        ),
        Concatenate([f"{_L}.experts._gate", f"{_L}.experts._up"], f"{_L}.experts.gate_up_proj", dim=1),
    )


def plait_to_hf_mapper(config: DecoderConfig, *, fused_experts: bool = False) -> Mapper:
    """Mapper from plait module keys to a Hugging Face checkpoint.

    Args:
        config: The model config (tied embeddings drop ``lm_head.weight`` like ``save_pretrained``).
        fused_experts: Write transformers 5.x's in-memory fused expert tensors instead of the
            per-expert keys ``save_pretrained`` writes (both load in transformers 5.x).
    """
    parts: list[Mapper] = []
    if fused_experts:
        parts.append(Rename({f"{_L}.router.weight": f"{_L}.gate.weight"}))
    else:
        parts.append(hf_to_plait_mapper(config).inverse())
    if config.tie_word_embeddings:
        parts.append(Drop("lm_head.weight"))
    return parts[0] if len(parts) == 1 else Sequential(*parts)
