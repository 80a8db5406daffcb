"""Mapper graphs between Hugging Face Qwen3 / Qwen3-MoE checkpoints and plait modules.

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

from plait.model_state.mappers import (
    Concatenate,
    Drop,
    Mapper,
    Parallel,
    Rename,
    Sequential,
    Stack,
)
from plait.models.config import Qwen3Config

__all__ = ["hf_to_plait_mapper", "plait_to_hf_mapper"]

_L = "model.layers.{i}.mlp"


def hf_to_plait_mapper(config: Qwen3Config | None = None) -> Mapper:
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


def plait_to_hf_mapper(config: Qwen3Config, *, fused_experts: bool = False) -> Mapper:
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
