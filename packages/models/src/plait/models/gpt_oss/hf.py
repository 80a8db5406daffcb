"""gpt-oss <-> Hugging Face: ``config.json`` and the checkpoint mappers.

Key layouts (per layer ``N``, under ``model.layers.N.mlp``):

* Hugging Face (``save_pretrained`` of a bf16/fp32 model): ``router.weight [E, H]``,
  ``router.bias [E]``, ``experts.gate_up_proj [E, H, 2I]`` (input-major, gate/up interleaved:
  gate in columns 0, 2, ...), ``experts.gate_up_proj_bias [E, 2I]`` (interleaved),
  ``experts.down_proj [E, I, H]``, ``experts.down_proj_bias [E, H]``.
* plait (:class:`plait.moe.GroupedExperts`): ``gate_up_proj [E, 2I, H]`` gate rows first,
  ``gate_up_proj_bias [E, 2I]`` gate half first, ``down_proj [E, H, I]``; the rest keeps HF's names.

The released checkpoints store the experts in MXFP4 (``*_blocks`` / ``*_scales`` tensors,
``quantization_config.quant_method = "mxfp4"``); reading them is refused with what to do instead.
"""

from __future__ import annotations

from typing import Any

from plait.model_state.mappers import Deinterleave, Drop, Mapper, Sequential, Transpose
from plait.models.common.config import DecoderConfig
from plait.models.common.hf.config import dump_hf_config, parse_hf_config
from plait.models.gpt_oss.config import GptOssConfig

__all__ = ["config_from_hf", "config_to_hf", "hf_to_plait_mapper", "plait_to_hf_mapper"]

_E = "model.layers.{i}.mlp.experts"


def config_from_hf(d: dict[str, Any]) -> GptOssConfig:
    """The plait config of a gpt-oss ``config.json`` dict (consumed).

    Raises:
        ValueError: naming an unsupported key or value, or a quantization plait cannot read.
    """
    quant = d.pop("quantization_config", None)
    if quant is not None:
        method = quant.get("quant_method") if isinstance(quant, dict) else quant
        raise ValueError(
            f"config.json quantization_config.quant_method={method!r}: plait reads gpt-oss checkpoints "
            "in bf16/fp32 only. Dequantize first, e.g. with transformers: "
            "GptOssForCausalLM.from_pretrained(dir, quantization_config=Mxfp4Config(dequantize=True), "
            "dtype=torch.bfloat16).save_pretrained(out)"
        )
    if "num_local_experts" in d:
        d["num_experts"] = d.pop("num_local_experts")
    if d.get("layer_types") is not None:
        d["layer_types"] = tuple(d["layer_types"])
    return parse_hf_config(d, GptOssConfig)


def config_to_hf(config: DecoderConfig) -> dict[str, Any]:
    """The ``config.json`` dict (transformers 5.x layout) of a gpt-oss config."""
    assert isinstance(config, GptOssConfig)
    d = dump_hf_config(config, "GptOssForCausalLM", exclude={"router_aux_loss_pooling", "num_experts"})
    d["num_local_experts"] = config.num_experts
    d["layer_types"] = list(config.resolved_layer_types)
    return d


def hf_to_plait_mapper(config: DecoderConfig | None = None) -> Mapper:
    """Hugging Face gpt-oss keys -> plait keys: the experts transposed to output-major and their
    gate/up columns de-interleaved; every other key passes through."""
    del config
    return Sequential(
        Transpose([f"{_E}.gate_up_proj", f"{_E}.down_proj"], 1, 2),
        Deinterleave([f"{_E}.gate_up_proj", f"{_E}.gate_up_proj_bias"], dim=1),
    )


def plait_to_hf_mapper(config: DecoderConfig, *, fused_experts: bool = False) -> Mapper:
    """plait keys -> Hugging Face gpt-oss keys (the inverse of :func:`hf_to_plait_mapper`; tied
    embeddings drop ``lm_head.weight``). gpt-oss checkpoints hold fused experts only, so
    ``fused_experts`` changes nothing."""
    del fused_experts
    out = hf_to_plait_mapper(config).inverse()
    return Sequential(out, Drop("lm_head.weight")) if config.tie_word_embeddings else out
