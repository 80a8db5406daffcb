"""Export to and import from the Hugging Face PEFT adapter format.

A directory with ``adapter_model.safetensors`` (keys ``base_model.model.<module>.lora_A.weight``,
``...lora_B.weight``, ``...lora_magnitude_vector`` for DoRA) and ``adapter_config.json`` (PEFT's
``LoraConfig`` field names). Per-module ranks/alphas go to ``rank_pattern``/``alpha_pattern``.
Module names can differ between plait and the transformers model: pass ``name_map`` (plait name
-> HF name on export, HF name -> plait name on import).
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from plait.peft.apply import PeftReport, apply_peft, expert_adapters, linear_adapters, trainable_parameters
from plait.peft.config import DoRAConfig, LoRAConfig
from plait.peft.io import _is_writer, copy_into, gather_full
from plait.peft.lora import DoRALinear
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

__all__ = ["HF_ADAPTER_CONFIG", "HF_ADAPTER_WEIGHTS", "HF_PREFIX", "export_hf_adapter", "import_hf_adapter"]

HF_ADAPTER_WEIGHTS = "adapter_model.safetensors"
HF_ADAPTER_CONFIG = "adapter_config.json"
HF_PREFIX = "base_model.model."

# adapter_config.json fields that change numerics and that plait does not implement
_UNSUPPORTED: dict[str, Any] = {
    "fan_in_fan_out": False,
    "lora_bias": False,
    "target_parameters": None,
    "modules_to_save": None,
    "layers_to_transform": None,
    "layer_replication": None,
    "trainable_token_indices": None,
    "use_qalora": False,
    "alora_invocation_tokens": None,
    "use_bdlora": None,
}
# HF key suffix -> plait parameter suffix (identical: LoRALinear mirrors PEFT's layout)
_SUFFIXES = ("lora_A.weight", "lora_B.weight", "lora_magnitude_vector")


def _num(x: float) -> int | float:
    return int(x) if float(x).is_integer() else float(x)


def export_hf_adapter(
    model: nn.Module,
    directory: str | os.PathLike[str],
    *,
    name_map: Callable[[str], str] | None = None,
    base_model_name_or_path: str | None = None,
    task_type: str | None = None,
    ignore_full_tune: bool = False,
) -> dict[str, Any]:
    """Write ``model``'s LoRA/DoRA linear adapters as a Hugging Face PEFT adapter directory.

    A collective on DTensor models (call on every rank; rank 0 writes).

    Args:
        model: a model passed through :func:`plait.peft.apply_peft` (unmerged).
        directory: output directory (created).
        name_map: plait module name -> transformers module name (identity if None).
        base_model_name_or_path: recorded in the config (``PeftModel`` does not need it).
        task_type: e.g. ``"CAUSAL_LM"``.
        ignore_full_tune: export even though other trainable parameters exist (they are left out);
            otherwise that is an error, since HF LoRA adapters cannot hold them.

    Returns:
        The written ``adapter_config.json`` contents.
    """
    if any(True for _ in expert_adapters(model)):
        raise NotImplementedError(
            "export_hf_adapter: grouped-expert adapters have no HF PEFT export yet; save them with save_adapter"
        )
    adapters = list(linear_adapters(model))
    if not adapters:
        raise ValueError("export_hf_adapter: the model has no LoRA/DoRA adapters")
    mapper = name_map or (lambda n: n)
    names = {name: mapper(name) for name, _ in adapters}
    for name, mod in adapters:
        if mod.merged:
            raise ValueError(f"export_hf_adapter: {name} is merged; unmerge before exporting")
        if mod.init == "pissa":
            raise NotImplementedError(
                f"export_hf_adapter: {name} uses PiSSA, whose base weight is the residual W - sBA; "
                "HF would apply it to the original weight. Export a merged model instead."
            )
    adapter_params = {
        id(p) for _, m in adapters for n, p in m.named_parameters() if not n.startswith("base_layer.")
    }
    extra = [n for n, p in trainable_parameters(model).items() if id(p) not in adapter_params]
    if extra and not ignore_full_tune:
        raise ValueError(
            f"export_hf_adapter: trainable parameters outside LoRA adapters cannot be exported to HF PEFT: "
            f"{extra[:5]} (pass ignore_full_tune=True to leave them out)"
        )
    dora = {isinstance(m, DoRALinear) for _, m in adapters}
    if len(dora) > 1:
        raise ValueError(
            "export_hf_adapter: HF PEFT has one use_dora per adapter; the model mixes LoRA and DoRA"
        )
    rslora = {m.use_rslora for _, m in adapters}
    if len(rslora) > 1:
        raise ValueError("export_hf_adapter: HF PEFT has one use_rslora per adapter; the model mixes both")
    r_default = Counter(m.r for _, m in adapters).most_common(1)[0][0]
    alpha_default = Counter(m.alpha for _, m in adapters).most_common(1)[0][0]
    dropout = max(m.lora_dropout.p if isinstance(m.lora_dropout, nn.Dropout) else 0.0 for _, m in adapters)

    tensors: dict[str, torch.Tensor] = {}
    for name, mod in adapters:
        key = HF_PREFIX + names[name]
        tensors[f"{key}.lora_A.weight"] = gather_full(mod.lora_A.weight)
        tensors[f"{key}.lora_B.weight"] = gather_full(mod.lora_B.weight)
        if isinstance(mod, DoRALinear):
            tensors[f"{key}.lora_magnitude_vector"] = gather_full(mod.lora_magnitude_vector)
    config: dict[str, Any] = {
        "peft_type": "LORA",
        "task_type": task_type,
        "base_model_name_or_path": base_model_name_or_path,
        "r": r_default,
        "lora_alpha": _num(alpha_default),
        "lora_dropout": dropout,
        "target_modules": sorted(names.values()),
        "rank_pattern": {re.escape(names[n]): m.r for n, m in adapters if m.r != r_default},
        "alpha_pattern": {
            re.escape(names[n]): _num(m.alpha) for n, m in adapters if m.alpha != alpha_default
        },
        "use_rslora": rslora.pop(),
        "use_dora": dora.pop(),
        "init_lora_weights": True,  # trained weights are loaded over it; never re-run PiSSA on load
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "revision": None,
        "exclude_modules": None,
        "target_parameters": None,
        "lora_bias": False,
    }
    if _is_writer():
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(out / HF_ADAPTER_WEIGHTS), metadata={"format": "pt"})
        (out / HF_ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return config


def _pattern_value(patterns: dict[str, Any], name: str, default: Any) -> Any:
    # PEFT's get_pattern_key: first key k with re.match(rf"(.*\.)?({k})$", name)
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", name):
            return value
    return default


def import_hf_adapter(
    model: nn.Module,
    directory: str | os.PathLike[str],
    *,
    name_map: Callable[[str], str] | None = None,
    apply: bool = True,
) -> PeftReport | None:
    """Load a Hugging Face PEFT LoRA/DoRA adapter directory into ``model``.

    Args:
        model: the base model (``apply=True``: adapters are injected from ``adapter_config.json``,
            everything else frozen) or a model already injected with matching adapters (``apply=False``).
        directory: contains ``adapter_config.json`` and ``adapter_model.safetensors``.
        name_map: transformers module name -> plait module name (identity if None).
        apply: inject adapters first.

    Returns:
        The :class:`plait.peft.PeftReport` of the injection (None with ``apply=False``).
    """
    src = Path(directory)
    cfg_path, weights_path = src / HF_ADAPTER_CONFIG, src / HF_ADAPTER_WEIGHTS
    for p in (cfg_path, weights_path):
        if not p.is_file():
            raise FileNotFoundError(f"import_hf_adapter: {p} does not exist")
    cfg = json.loads(cfg_path.read_text())
    if cfg.get("peft_type") != "LORA":
        raise ValueError(
            f"import_hf_adapter: peft_type={cfg.get('peft_type')!r}; only 'LORA' (with use_dora) is supported"
        )
    for field, ok in _UNSUPPORTED.items():
        value = cfg.get(field, ok)
        if value not in (ok, [], {}) and not (field == "modules_to_save" and not value):
            raise ValueError(
                f"import_hf_adapter: adapter_config.json field {field}={value!r} is not supported"
            )
    if cfg.get("bias", "none") != "none":
        raise ValueError(
            f"import_hf_adapter: adapter_config.json field bias={cfg['bias']!r} is not supported"
        )
    mapper = name_map or (lambda n: n)

    with safe_open(str(weights_path), framework="pt") as f:
        raw = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not a mapping)
    tensors: dict[str, torch.Tensor] = {}
    hf_modules: dict[str, str] = {}  # hf name -> plait name
    for key, value in raw.items():
        if not key.startswith(HF_PREFIX):
            raise KeyError(f"import_hf_adapter: key {key!r} does not start with {HF_PREFIX!r}")
        body = key[len(HF_PREFIX) :]
        for suffix in _SUFFIXES:
            if body.endswith("." + suffix):
                hf_name = body[: -len(suffix) - 1]
                hf_modules[hf_name] = mapper(hf_name)
                tensors[f"{hf_modules[hf_name]}.{suffix}"] = value
                break
        else:
            raise KeyError(f"import_hf_adapter: unsupported key {key!r}")

    report = None
    if apply:
        groups: dict[tuple[int, float], list[str]] = {}
        r0, a0 = int(cfg["r"]), float(cfg["lora_alpha"])
        for hf_name, name in hf_modules.items():
            r = int(_pattern_value(cfg.get("rank_pattern") or {}, hf_name, r0))
            alpha = float(_pattern_value(cfg.get("alpha_pattern") or {}, hf_name, a0))
            groups.setdefault((r, alpha), []).append(name)
        cls = DoRAConfig if cfg.get("use_dora") else LoRAConfig
        configs = [
            cls(
                r=r,
                alpha=alpha,
                dropout=float(cfg.get("lora_dropout") or 0.0),
                use_rslora=bool(cfg.get("use_rslora")),
                init="kaiming",
                target_modules="|".join(re.escape(n) for n in sorted(names)),
            )
            for (r, alpha), names in sorted(groups.items())
        ]
        report = apply_peft(model, configs)
    params = dict(model.named_parameters())
    wanted = set(hf_modules.values())
    expected = {
        f"{n}.{s}"
        for n, m in linear_adapters(model)
        if n in wanted
        for s in _SUFFIXES
        if s != "lora_magnitude_vector" or isinstance(m, DoRALinear)
    }
    missing = sorted(expected - set(tensors))
    if missing:
        raise KeyError(f"import_hf_adapter: adapter file lacks {missing[:5]}")
    for name, value in tensors.items():
        if name not in params:
            raise KeyError(f"import_hf_adapter: the model has no parameter {name!r}")
        copy_into(params[name], value, name=name)
    return report
