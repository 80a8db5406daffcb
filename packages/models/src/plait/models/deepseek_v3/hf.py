"""DeepSeek-V3 <-> Hugging Face: ``config.json``, the checkpoint mappers, FP8 dequantization and
the multi-token-prediction weights.

Key layouts (per MoE layer ``N``, under ``model.layers.N.mlp``):

* Hugging Face on disk (``save_pretrained`` in transformers 5.x, DeepSeek's released checkpoints):
  ``gate.weight [E, H]``, ``gate.e_score_correction_bias [E]``, per expert
  ``experts.E.{gate,up,down}_proj.weight``, ``shared_experts.{gate,up,down}_proj.weight``.
* Hugging Face in memory (transformers 5.x): fused ``experts.gate_up_proj [E, 2I, H]`` and
  ``experts.down_proj [E, H, I]``, as plait's.
* plait: ``router.weight``, ``router.expert_bias`` (the correction bias, fp32),
  ``experts.gate_up_proj`` / ``experts.down_proj``, ``shared_expert.{gate,up,down}_proj.weight``.
  Attention and dense layers keep Hugging Face's names.

DeepSeek's released checkpoints are block-scaled FP8 (``quantization_config`` with ``fmt``
``e4m3`` and ``weight_block_size``; every quantized ``X.weight`` is ``float8_e4m3fn`` with a fp32
``X.weight_scale_inv`` of one scale per block): :class:`Fp8BlockDequantize` turns each pair into
the dequantized ``X.weight`` group by group while the checkpoint streams. They also carry the
multi-token-prediction module as ``model.layers.{num_hidden_layers + i}.*``: plait does not build it
and skips those keys (:class:`SkipLayersFrom`, with a logged note).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
from plait.model_state import TensorSpec
from plait.model_state.errors import MapperError
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
from plait.model_state.specs import Region
from plait.models.common.config import DecoderConfig
from plait.models.common.hf.config import dump_hf_config, parse_hf_config
from plait.models.deepseek_v3.config import DeepseekV3Config

__all__ = [
    "Duplicate",
    "Fp8BlockDequantize",
    "SkipLayersFrom",
    "config_from_hf",
    "config_to_hf",
    "hf_to_plait_mapper",
    "plait_to_hf_mapper",
]

logger = logging.getLogger(__name__)

_L = "model.layers.{i}.mlp"
# config.json keys of DeepSeek's own releases that do not change the model plait builds.
_IGNORED = ("aux_loss_alpha", "seq_aux", "ep_size", "auto_map", "qk_head_dim")


def _quantization(quant: object) -> tuple[int, int]:
    """The FP8 block size of a ``quantization_config``, or an error naming what is unsupported."""
    if not isinstance(quant, dict):
        raise ValueError(f"config.json quantization_config={quant!r} is not supported")
    method, fmt, block = quant.get("quant_method"), quant.get("fmt", "e4m3"), quant.get("weight_block_size")
    if method != "fp8":
        raise ValueError(
            f"config.json quantization_config.quant_method={method!r} is not supported "
            "(plait dequantizes block-scaled 'fp8' checkpoints only)"
        )
    if fmt != "e4m3":
        raise ValueError(f"config.json quantization_config.fmt={fmt!r} is not supported (only 'e4m3')")
    if not (
        isinstance(block, list | tuple)
        and len(block) == 2
        and all(isinstance(b, int) and b > 0 for b in block)
    ):
        raise ValueError(
            f"config.json quantization_config.weight_block_size={block!r} is not supported "
            "(two positive ints, e.g. [128, 128])"
        )
    return int(block[0]), int(block[1])


def config_from_hf(d: dict[str, Any]) -> DeepseekV3Config:
    """The plait config of a DeepSeek-V3 ``config.json`` dict (consumed).

    ``head_dim``, ``num_key_value_heads`` and ``qk_head_dim`` are derived values in transformers'
    config (MLA has one key/value per head) and are not read. A ``quantization_config`` must be
    DeepSeek's block-scaled FP8 (its block size goes to ``fp8_block_size``).

    Raises:
        ValueError: naming an unsupported key or value.
    """
    quant = d.pop("quantization_config", None)
    if quant is not None:
        d["fp8_block_size"] = _quantization(quant)
    for key in ("head_dim", "num_key_value_heads"):
        d.pop(key, None)
    if "num_mtp_layers" in d:
        d.setdefault("num_nextn_predict_layers", d.pop("num_mtp_layers"))
        d.pop("num_mtp_layers", None)
    freq = d.pop("moe_layer_freq", 1)
    if freq != 1:
        raise ValueError(f"config.json moe_layer_freq={freq!r} is not supported (only 1)")
    return parse_hf_config(d, DeepseekV3Config, ignored=_IGNORED, drop_none=())


def config_to_hf(config: DecoderConfig) -> dict[str, Any]:
    """The ``config.json`` dict (transformers 5.x layout) of a DeepSeek-V3 config (plait-only fields
    left out; an FP8 import is exported dequantized, without ``quantization_config``)."""
    assert isinstance(config, DeepseekV3Config)
    return dump_hf_config(
        config,
        "DeepseekV3ForCausalLM",
        exclude={"bias_update_rate", "seq_aux_loss_coef", "fp8_block_size", "mtp_loss_weight"},
    )


class SkipLayersFrom(Mapper):
    """Drops (never reads) ``model.layers.{i}.*`` for ``i >= first``: the multi-token-prediction
    modules DeepSeek-V3 checkpoints store after the decoder layers; logs a note when it does."""

    def __init__(self, first: int) -> None:
        self.first = first

    def groups(self, source: Mapping[str, TensorSpec]) -> list[MapperGroup]:
        hit = []
        for k in source:
            parts = k.split(".")
            if len(parts) > 3 and parts[:2] == ["model", "layers"] and parts[2].isdigit():
                hit += [k] if int(parts[2]) >= self.first else []
        if not hit:
            return []
        logger.warning(
            "skipping %d checkpoint tensors of layers >= %d (multi-token-prediction modules, which plait "
            "does not build; they are not exported either)",
            len(hit),
            self.first,
        )
        return [MapperGroup.drop(hit, repr(self))]

    def __repr__(self) -> str:
        return f"SkipLayersFrom({self.first})"


_SCALE = "_scale_inv"


class Fp8BlockDequantize(Mapper):
    """``X.weight`` (``float8_e4m3fn`` ``[R, C]``) + ``X.weight_scale_inv`` (fp32
    ``[ceil(R / br), ceil(C / bc)]``) -> ``X.weight`` = weight x the scale of its block, in
    ``dtype``. A region of the output reads only the weight's region and the scales of its blocks.

    Args:
        block_size: ``(br, bc)``, the checkpoint's ``weight_block_size``; None: the checkpoint must
            hold no FP8 tensors (an error names one that it holds: the block size is not guessed).
        dtype: Dtype of the dequantized weights.

    Raises:
        MapperError: (from :meth:`groups`) an FP8 weight without its scale tensor, a scale without its
            weight, a scale of the wrong shape, FP8 tensors without a block size (each names the tensor).
    """

    def __init__(self, block_size: tuple[int, int] | None, dtype: torch.dtype = torch.float32) -> None:
        self.block_size = block_size
        self.dtype = dtype

    def groups(self, source: Mapping[str, TensorSpec]) -> list[MapperGroup]:
        out = []
        for key, spec in source.items():
            if key.endswith(_SCALE):
                weight = key.removesuffix(_SCALE)
                if weight not in source:
                    raise MapperError(f"checkpoint tensor {key!r} has no weight {weight!r} to scale")
                continue
            if spec.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
                if key + _SCALE in source:
                    raise MapperError(f"checkpoint tensor {key!r} has a scale but is {spec.dtype}, not FP8")
                continue
            if self.block_size is None:
                raise MapperError(
                    f"checkpoint tensor {key!r} is {spec.dtype} but the model config has no fp8_block_size "
                    "(load_hf_config sets it from config.json's quantization_config.weight_block_size; "
                    "build the model from that config, or set fp8_block_size, e.g. (128, 128))"
                )
            scale = key + _SCALE
            if scale not in source:
                raise MapperError(f"FP8 checkpoint tensor {key!r} has no scale tensor {scale!r}")
            out.append(self._group(key, spec, source[scale]))
        return out

    def _group(self, key: str, spec: TensorSpec, scale_spec: TensorSpec) -> MapperGroup:
        assert self.block_size is not None
        br, bc = self.block_size
        if len(spec.shape) != 2:
            raise MapperError(f"FP8 checkpoint tensor {key!r} has shape {list(spec.shape)}: expected 2 dims")
        rows, cols = spec.shape
        want = (-(-rows // br), -(-cols // bc))
        if tuple(scale_spec.shape) != want:
            raise MapperError(
                f"scale tensor {key + _SCALE!r} has shape {list(scale_spec.shape)}, expected {list(want)} "
                f"for {key!r} {list(spec.shape)} in blocks of {[br, bc]}"
            )
        scale, dtype = key + _SCALE, self.dtype

        def dequant(r0: int, c0: int) -> Any:
            def fn(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
                w, s = t[key], t[scale]
                ri = torch.arange(r0, r0 + w.shape[0], device=w.device) // br - r0 // br
                ci = torch.arange(c0, c0 + w.shape[1], device=w.device) // bc - c0 // bc
                return {key: (w.to(torch.float32) * s.to(torch.float32)[ri][:, ci]).to(dtype)}

            return fn

        def slicer(regions: Mapping[str, Region | None]) -> tuple[dict[str, Region | None], Any]:
            r = regions.get(key)
            if r is None:
                return {key: None, scale: None}, dequant(0, 0)
            (a, b), (c, d) = r
            sr = ((a // br, -(-b // br)), (c // bc, -(-d // bc))) if b > a and d > c else ((0, 0), (0, 0))
            return {key: r, scale: sr}, dequant(a, c)

        return MapperGroup(
            (key, scale), {key: TensorSpec(spec.shape, dtype)}, dequant(0, 0), slicer, None, repr(self)
        )

    def __repr__(self) -> str:
        return f"Fp8BlockDequantize({self.block_size})"


def _moe_mapper() -> Mapper:
    """Per-expert keys stacked (gate/up concatenated into ``gate_up_proj``), the router and the
    shared experts renamed."""
    return Sequential(
        Parallel(
            Rename(
                {
                    f"{_L}.gate.weight": f"{_L}.router.weight",
                    f"{_L}.gate.e_score_correction_bias": f"{_L}.router.expert_bias",
                    f"{_L}.shared_experts.{{*p}}": f"{_L}.shared_expert.{{*p}}",
                }
            ),
            Stack(f"{_L}.experts.{{e}}.gate_proj.weight", f"{_L}.experts._gate", over="e"),
            Stack(f"{_L}.experts.{{e}}.up_proj.weight", f"{_L}.experts._up", over="e"),
            Stack(f"{_L}.experts.{{e}}.down_proj.weight", f"{_L}.experts.down_proj", over="e"),
        ),
        Concatenate([f"{_L}.experts._gate", f"{_L}.experts._up"], f"{_L}.experts.gate_up_proj", dim=1),
    )


class Duplicate(Mapper):
    """Reads ``source`` once and writes it under its own key and under each of ``copies`` (the
    embedding and head copies DeepSeek-V3 checkpoints store in every MTP layer)."""

    def __init__(self, source: str, copies: list[str]) -> None:
        self.source, self.copies = source, copies

    def groups(self, source: Mapping[str, TensorSpec]) -> list[MapperGroup]:
        if self.source not in source or not self.copies:
            return []
        spec, src, copies = source[self.source], self.source, self.copies

        def fn(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            return {src: t[src], **{c: t[src] for c in copies}}

        outputs = {src: spec, **dict.fromkeys(copies, spec)}
        return [MapperGroup((src,), outputs, fn, None, None, repr(self))]

    def __repr__(self) -> str:
        return f"Duplicate({self.source!r} -> {self.copies})"


def _mtp_rename(config: DeepseekV3Config) -> Mapper:
    """``model.layers.{idx}.*`` of each MTP module -> ``mtp.{idx}.*`` (its decoder layer under
    ``block``)."""
    rules: list[tuple[str, str]] = []
    for idx in config.mtp_layer_ids:
        src, dst = f"model.layers.{idx}", f"mtp.{idx}"
        for own in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight"):
            rules.append((f"{src}.{own}", f"{dst}.{own}"))
        rules.append((f"{src}.{{*rest}}", f"{dst}.block.{{*rest}}"))
    return Rename(rules)


def _mtp_copies(config: DeepseekV3Config) -> tuple[list[str], list[str]]:
    """The embedding and head copies of the MTP layers' checkpoint keys."""
    ids = config.mtp_layer_ids
    return [f"model.layers.{i}.embed_tokens.weight" for i in ids], [
        f"model.layers.{i}.shared_head.head.weight" for i in ids
    ]


def hf_to_plait_mapper(config: DecoderConfig) -> Mapper:
    """Hugging Face DeepSeek-V3 keys (either expert layout, bf16/fp32 or block-scaled FP8) -> plait
    keys. The multi-token-prediction layers map to ``mtp.{idx}.*`` with ``mtp_loss_weight`` (their
    embedding and head copies are dropped: plait shares the model's), else are skipped (logged)."""
    assert isinstance(config, DeepseekV3Config)
    parts: list[Mapper] = [SkipLayersFrom(config.num_hidden_layers + len(config.mtp_layer_ids))]
    embeds, heads = _mtp_copies(config)
    if embeds:
        parts.append(Drop(*embeds, *heads))
    parts += [Fp8BlockDequantize(config.fp8_block_size), _moe_mapper()]
    if config.mtp_layer_ids:
        parts.append(_mtp_rename(config))
    return Sequential(*parts)


def plait_to_hf_mapper(config: DecoderConfig, *, fused_experts: bool = False) -> Mapper:
    """plait keys -> Hugging Face DeepSeek-V3 keys (unquantized; tied embeddings drop
    ``lm_head.weight``); MTP modules go back to ``model.layers.{idx}.*`` with the copies of the
    embedding and head that DeepSeek's checkpoints store there.

    Args:
        config: The model config.
        fused_experts: Write transformers 5.x's in-memory fused expert tensors instead of the
            per-expert keys ``save_pretrained`` writes.
    """
    assert isinstance(config, DeepseekV3Config)
    parts: list[Mapper] = []
    if config.mtp_layer_ids:
        parts.append(_mtp_rename(config).inverse())
    if fused_experts:
        parts.append(
            Rename(
                {
                    f"{_L}.router.weight": f"{_L}.gate.weight",
                    f"{_L}.router.expert_bias": f"{_L}.gate.e_score_correction_bias",
                    f"{_L}.shared_expert.{{*p}}": f"{_L}.shared_experts.{{*p}}",
                }
            )
        )
    else:
        parts.append(_moe_mapper().inverse())
    embeds, heads = _mtp_copies(config)
    if config.tie_word_embeddings:
        parts.append(Drop("lm_head.weight"))
        if embeds:
            parts.append(Duplicate("model.embed_tokens.weight", embeds + heads))
    elif embeds:
        parts += [Duplicate("model.embed_tokens.weight", embeds), Duplicate("lm_head.weight", heads)]
    return parts[0] if len(parts) == 1 else Sequential(*parts)
