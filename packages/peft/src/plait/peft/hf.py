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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from plait.peft.apply import PeftReport, apply_peft, expert_adapters, linear_adapters, trainable_parameters
from plait.peft.config import DoRAConfig, LoRAConfig
from plait.peft.experts import ExpertLoRA, expert_adapters_of
from plait.peft.io import _is_writer, copy_into, gather_full
from plait.peft.lora import DoRALinear
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

__all__ = [
    "HF_ADAPTER_CONFIG",
    "HF_ADAPTER_WEIGHTS",
    "HF_PREFIX",
    "ExpertOutOrder",
    "export_hf_adapter",
    "import_hf_adapter",
]

HF_ADAPTER_WEIGHTS = "adapter_model.safetensors"
HF_ADAPTER_CONFIG = "adapter_config.json"
HF_PREFIX = "base_model.model."

# adapter_config.json fields that change numerics and that plait does not implement
_UNSUPPORTED: dict[str, Any] = {
    "fan_in_fan_out": False,
    "lora_bias": False,
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
    expert_out_order: ExpertOutOrder | None = None,
) -> dict[str, Any]:
    """Write ``model``'s adapters as a Hugging Face PEFT adapter directory.

    LoRA/DoRA linear adapters become ``target_modules`` entries; grouped-expert adapters become
    ``target_parameters`` entries in PEFT's ``ParamWrapper`` layout (``lora_A [E*r, in]``,
    ``lora_B [out, r*E]``; several parameters of one module nest as ``<module>.base_layer...``,
    the first registered parameter innermost). A collective on DTensor models (rank 0 writes).

    Args:
        model: a model passed through :func:`plait.peft.apply_peft` (unmerged).
        directory: output directory (created).
        name_map: plait module name -> transformers module name (identity if None); expert
            parameters keep their attribute names.
        base_model_name_or_path: recorded in the config (``PeftModel`` does not need it).
        task_type: e.g. ``"CAUSAL_LM"``.
        ignore_full_tune: export even though other trainable parameters exist (they are left out);
            otherwise that is an error, since HF LoRA adapters cannot hold them.
        expert_out_order: for expert parameters whose HF output axis is ordered differently from
            plait's (gpt-oss's gate/up-interleaved ``gate_up_proj``): plait parameter name ->
            index ``p`` with HF output row ``j`` = plait output row ``p[j]`` (e.g.
            ``plait.moe.interleaved_order(I)``), or None to keep the order. An input-major HF
            weight needs nothing here: PEFT reads in/out from the module's ``is_transposed``.

    Returns:
        The written ``adapter_config.json`` contents.
    """
    adapters = list(linear_adapters(model))
    experts = list(expert_adapters(model))
    if not adapters and not experts:
        raise ValueError("export_hf_adapter: the model has no LoRA/DoRA adapters")
    mapper = name_map or (lambda n: n)
    names = {name: mapper(name) for name, _ in adapters}
    _check_exportable(model, adapters, experts, ignore_full_tune)
    settings = _export_settings(adapters, experts)
    tensors = _linear_tensors(adapters, names)
    expert_tensors, target_parameters = _expert_tensors(experts, mapper, expert_out_order)
    tensors.update(expert_tensors)
    config = _hf_config(settings, adapters, names, target_parameters, base_model_name_or_path, task_type)
    if _is_writer():
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(out / HF_ADAPTER_WEIGHTS), metadata={"format": "pt"})
        (out / HF_ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return config


_Linear = list[tuple[str, Any]]  # (module name, LoRALinear / DoRALinear)
_Experts = list[tuple[str, nn.Module, ExpertLoRA]]  # (host name, host, adapter)


def _every(adapters: _Linear, experts: _Experts) -> list[tuple[str, Any]]:
    return list(adapters) + [(f"{h}.{a.param_name}", a) for h, _, a in experts]


def _check_exportable(model: nn.Module, adapters: _Linear, experts: _Experts, ignore_full_tune: bool) -> None:
    """Unmerged, not PiSSA, and (unless ignored) no trainable parameter outside the adapters."""
    for name, mod in _every(adapters, experts):
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
    adapter_params |= {id(p) for _, _, a in experts for p in a.parameters()}
    extra = [n for n, p in trainable_parameters(model).items() if id(p) not in adapter_params]
    if extra and not ignore_full_tune:
        raise ValueError(
            f"export_hf_adapter: trainable parameters outside LoRA adapters cannot be exported to HF PEFT: "
            f"{extra[:5]} (pass ignore_full_tune=True to leave them out)"
        )


@dataclass(frozen=True)
class _Settings:
    """The adapter-wide fields of ``adapter_config.json``."""

    r: int
    alpha: float
    dropout: float
    use_rslora: bool
    use_dora: bool


def _export_settings(adapters: _Linear, experts: _Experts) -> _Settings:
    """The adapter-wide settings (the most common rank and alpha); errors for what HF PEFT cannot hold."""
    every = _every(adapters, experts)
    dora = {isinstance(m, DoRALinear) for _, m in adapters}
    if len(dora) > 1 or (experts and True in dora):
        raise ValueError(
            "export_hf_adapter: HF PEFT has one use_dora per adapter; the model mixes LoRA and DoRA"
        )
    rslora = {m.use_rslora for _, m in every}
    if len(rslora) > 1:
        raise ValueError("export_hf_adapter: HF PEFT has one use_rslora per adapter; the model mixes both")
    r_default = Counter(m.r for _, m in every).most_common(1)[0][0]
    alpha_default = Counter(m.alpha for _, m in every).most_common(1)[0][0]
    dropout = max(m.lora_dropout.p if isinstance(m.lora_dropout, nn.Dropout) else 0.0 for _, m in every)
    for name, ad in every[len(adapters) :]:
        if (ad.r, ad.alpha) != (r_default, alpha_default):
            raise NotImplementedError(
                f"export_hf_adapter: expert adapter {name} has r={ad.r}, alpha={ad.alpha}; HF export of expert "
                f"adapters needs the adapter-wide r={r_default}, alpha={alpha_default}"
            )
    if experts and dropout > 0:
        raise ValueError(
            "export_hf_adapter: HF PEFT's target_parameters (expert LoRA) does not allow lora_dropout > 0"
        )
    return _Settings(r_default, alpha_default, dropout, rslora.pop(), bool(dora and dora.pop()))


def _linear_tensors(adapters: _Linear, names: dict[str, str]) -> dict[str, torch.Tensor]:
    """HF keys and full tensors of the linear adapters."""
    tensors: dict[str, torch.Tensor] = {}
    for name, mod in adapters:
        key = HF_PREFIX + names[name]
        tensors[f"{key}.lora_A.weight"] = gather_full(mod.lora_A.weight)
        tensors[f"{key}.lora_B.weight"] = gather_full(mod.lora_B.weight)
        if isinstance(mod, DoRALinear):
            tensors[f"{key}.lora_magnitude_vector"] = gather_full(mod.lora_magnitude_vector)
    return tensors


def _expert_tensors(
    experts: _Experts, mapper: Callable[[str], str], expert_out_order: ExpertOutOrder | None
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """HF keys and tensors of the expert adapters in PEFT's ``ParamWrapper`` layout, and their targets."""
    tensors: dict[str, torch.Tensor] = {}
    target_parameters: list[str] = []
    hosts = {h: host for h, host, _ in experts}
    for host_name, host in hosts.items():
        targeted = _targeted_in_order(host)
        hf_host = mapper(host_name)
        for i, pname in enumerate(targeted):
            held = expert_adapters_of(host)
            assert held is not None
            ad = held[pname]
            assert isinstance(ad, ExpertLoRA)
            key = HF_PREFIX + hf_host + ".base_layer" * (len(targeted) - 1 - i)
            a, b = gather_full(ad.lora_A), gather_full(ad.lora_B)  # [E, r, in], [E, out, r]
            order = _out_order(expert_out_order, f"{host_name}.{pname}", b.shape[1])
            if order is not None:
                b = b[:, order]
            tensors[f"{key}.lora_A.weight"] = a.reshape(-1, a.shape[-1]).contiguous()  # [E*r, in]
            tensors[f"{key}.lora_B.weight"] = (
                b.permute(1, 2, 0).reshape(b.shape[1], -1).contiguous()
            )  # [out, r*E]
            target_parameters.append(f"{hf_host}.{pname}")
    return tensors, target_parameters


def _hf_config(
    s: _Settings,
    adapters: _Linear,
    names: dict[str, str],
    target_parameters: list[str],
    base_model_name_or_path: str | None,
    task_type: str | None,
) -> dict[str, Any]:
    """``adapter_config.json`` with PEFT's ``LoraConfig`` field names."""
    return {
        "peft_type": "LORA",
        "task_type": task_type,
        "base_model_name_or_path": base_model_name_or_path,
        "r": s.r,
        "lora_alpha": _num(s.alpha),
        "lora_dropout": s.dropout,
        "target_modules": sorted(names.values()) if names else None,
        "target_parameters": target_parameters or None,
        "rank_pattern": {re.escape(names[n]): m.r for n, m in adapters if m.r != s.r},
        "alpha_pattern": {re.escape(names[n]): _num(m.alpha) for n, m in adapters if m.alpha != s.alpha},
        "use_rslora": s.use_rslora,
        "use_dora": s.use_dora,
        "init_lora_weights": True,  # trained weights are loaded over it; never re-run PiSSA on load
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "revision": None,
        "exclude_modules": None,
        "lora_bias": False,
    }


ExpertOutOrder = Callable[[str], torch.Tensor | None]
"""plait expert parameter name -> index ``p`` (HF output row ``j`` = plait row ``p[j]``) or None."""


def _out_order(fn: ExpertOutOrder | None, name: str, rows: int) -> torch.Tensor | None:
    order = None if fn is None else fn(name)
    if order is None:
        return None
    order = torch.as_tensor(order, dtype=torch.int64)
    if order.shape != (rows,) or not torch.equal(order.sort().values, torch.arange(rows)):
        raise ValueError(
            f"expert_out_order({name!r}) must be a permutation of its {rows} output rows, got shape "
            f"{tuple(order.shape)}"
        )
    return order


def _targeted_in_order(host: nn.Module) -> list[str]:
    """The host's adapted parameters in registration order (PEFT nests them in that order)."""
    adapters = expert_adapters_of(host)
    assert adapters is not None
    return [p for p in host._parameters if p in adapters]


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
    require_expert_hook: bool = True,
    expert_out_order: ExpertOutOrder | None = None,
) -> PeftReport | None:
    """Load a Hugging Face PEFT LoRA/DoRA adapter directory into ``model``.

    ``target_modules`` adapters become :class:`plait.peft.LoRALinear`/``DoRALinear``; ``target_parameters``
    (PEFT's expert LoRA on 3-D ``[E, out, in]`` parameters) become :class:`plait.peft.ExpertLoRA`.

    Args:
        model: the base model (``apply=True``: adapters are injected from ``adapter_config.json``,
            everything else frozen) or a model already injected with matching adapters (``apply=False``).
        directory: contains ``adapter_config.json`` and ``adapter_model.safetensors``.
        name_map: transformers module name -> plait module name (identity if None).
        apply: inject adapters first.
        require_expert_hook: see :func:`plait.peft.apply_peft` (False to import expert adapters
            into modules that do not call them, e.g. transformers' experts, for merging).
        expert_out_order: as in :func:`export_hf_adapter` (the same function: the HF rows are put
            back in plait's order).

    Returns:
        The :class:`plait.peft.PeftReport` of the injection (None with ``apply=False``).
    """
    cfg, weights_path = _read_config(Path(directory))
    mapper = name_map or (lambda n: n)
    with safe_open(str(weights_path), framework="pt") as f:
        raw = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not a mapping)
    keys = _place_keys(model, raw, list(cfg.get("target_parameters") or []), mapper)
    report = _inject(model, cfg, keys, require_expert_hook) if apply else None
    _load_linear(model, keys)
    _load_experts(model, keys.experts, expert_out_order)
    return report


def _read_config(src: Path) -> tuple[dict[str, Any], Path]:
    """``adapter_config.json`` (checked for what plait supports) and the weights file's path."""
    cfg_path, weights_path = src / HF_ADAPTER_CONFIG, src / HF_ADAPTER_WEIGHTS
    for p in (cfg_path, weights_path):
        if not p.is_file():
            raise FileNotFoundError(f"import_hf_adapter: {p} does not exist")
    cfg = json.loads(cfg_path.read_text())
    if cfg.get("peft_type") != "LORA":
        raise ValueError(
            f"import_hf_adapter: peft_type={cfg.get('peft_type')!r}; only 'LORA' (with use_dora) is supported"
        )
    for name, ok in _UNSUPPORTED.items():
        value = cfg.get(name, ok)
        if value not in (ok, [], {}) and not (name == "modules_to_save" and not value):
            raise ValueError(
                f"import_hf_adapter: adapter_config.json field {name}={value!r} is not supported"
            )
    if cfg.get("bias", "none") != "none":
        raise ValueError(
            f"import_hf_adapter: adapter_config.json field bias={cfg['bias']!r} is not supported"
        )
    return cfg, weights_path


@dataclass
class _Keys:
    """The adapter file's tensors by where they go in the model.

    Attributes:
        linear: plait ``<module>.<suffix>`` -> tensor (linear adapters).
        modules: HF module name -> plait module name (linear adapters).
        experts: plait ``<host>.<param>`` -> {suffix: tensor} (expert adapters).
    """

    linear: dict[str, torch.Tensor] = field(default_factory=dict)
    modules: dict[str, str] = field(default_factory=dict)
    experts: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)


def _targeted_on(
    model: nn.Module, hf_host: str, target_params: list[str], mapper: Callable[[str], str]
) -> list[str]:
    """The parameters of ``hf_host`` that ``target_params`` names, in registration order.

    PEFT's matching: ``"<module>.<param>"`` equals a target or ends with ``"." + target``.
    """
    try:
        host = model.get_submodule(mapper(hf_host))
    except AttributeError:
        return []
    return [
        p
        for p, v in host._parameters.items()
        if v is not None
        and any(f"{hf_host}.{p}" == t or f"{hf_host}.{p}".endswith("." + t) for t in target_params)
    ]


def _place_keys(
    model: nn.Module, raw: dict[str, torch.Tensor], target_params: list[str], mapper: Callable[[str], str]
) -> _Keys:
    """Sort the file's keys into linear and expert adapters (nested ``base_layer`` levels: one per parameter)."""
    keys = _Keys()
    for key, value in raw.items():
        if not key.startswith(HF_PREFIX):
            raise KeyError(f"import_hf_adapter: key {key!r} does not start with {HF_PREFIX!r}")
        body = key[len(HF_PREFIX) :]
        suffix = next((sfx for sfx in _SUFFIXES if body.endswith("." + sfx)), None)
        if suffix is None:
            raise KeyError(f"import_hf_adapter: unsupported key {key!r}")
        hf_name, depth = body[: -len(suffix) - 1], 0
        while hf_name.endswith(".base_layer"):  # nested ParamWrappers: one level per targeted parameter
            hf_name, depth = hf_name[: -len(".base_layer")], depth + 1
        targeted = _targeted_on(model, hf_name, target_params, mapper) if target_params else []
        if targeted:
            if depth >= len(targeted) or suffix == "lora_magnitude_vector":
                raise KeyError(
                    f"import_hf_adapter: cannot place key {key!r} (targeted parameters {targeted})"
                )
            pname = targeted[len(targeted) - 1 - depth]  # the first registered parameter is innermost
            keys.experts.setdefault(f"{mapper(hf_name)}.{pname}", {})[suffix] = value
        elif depth:
            raise KeyError(f"import_hf_adapter: key {key!r} is nested but matches no target_parameters entry")
        else:
            keys.modules[hf_name] = mapper(hf_name)
            keys.linear[f"{keys.modules[hf_name]}.{suffix}"] = value
    return keys


def _inject(model: nn.Module, cfg: dict[str, Any], keys: _Keys, require_expert_hook: bool) -> PeftReport:
    """Apply the adapters ``adapter_config.json`` describes (one config per rank and alpha)."""
    groups: dict[tuple[int, float], list[str]] = {}
    r0, a0 = int(cfg["r"]), float(cfg["lora_alpha"])
    for hf_name, name in keys.modules.items():
        r = int(_pattern_value(cfg.get("rank_pattern") or {}, hf_name, r0))
        alpha = float(_pattern_value(cfg.get("alpha_pattern") or {}, hf_name, a0))
        groups.setdefault((r, alpha), []).append(name)
    common = {
        "dropout": float(cfg.get("lora_dropout") or 0.0),
        "use_rslora": bool(cfg.get("use_rslora")),
        "init": "kaiming",
    }
    cls: type[LoRAConfig] | type[DoRAConfig] = DoRAConfig if cfg.get("use_dora") else LoRAConfig
    configs: list[LoRAConfig | DoRAConfig] = [
        cls(r=r, alpha=alpha, target_modules="|".join(re.escape(n) for n in sorted(names)), **common)  # type: ignore[arg-type]
        for (r, alpha), names in sorted(groups.items())
    ]
    if keys.experts:
        pattern = "|".join(re.escape(n) for n in sorted(keys.experts))
        configs.append(LoRAConfig(r=r0, alpha=a0, target_parameters=pattern, **common))  # type: ignore[arg-type]
    return apply_peft(model, configs, require_expert_hook=require_expert_hook)


def _load_linear(model: nn.Module, keys: _Keys) -> None:
    """Copy the linear adapters' tensors; every adapter of a named module must be in the file."""
    params = dict(model.named_parameters())
    wanted = set(keys.modules.values())
    expected = {
        f"{n}.{s}"
        for n, m in linear_adapters(model)
        if n in wanted
        for s in _SUFFIXES
        if s != "lora_magnitude_vector" or isinstance(m, DoRALinear)
    }
    missing = sorted(expected - set(keys.linear))
    if missing:
        raise KeyError(f"import_hf_adapter: adapter file lacks {missing[:5]}")
    for name, value in keys.linear.items():
        if name not in params:
            raise KeyError(f"import_hf_adapter: the model has no parameter {name!r}")
        copy_into(params[name], value, name=name)


def _load_experts(
    model: nn.Module, experts: dict[str, dict[str, torch.Tensor]], expert_out_order: ExpertOutOrder | None
) -> None:
    """Copy the expert adapters' tensors from PEFT's ``ParamWrapper`` layout."""
    for full, parts in experts.items():
        host_name, _, pname = full.rpartition(".")
        host = model.get_submodule(host_name) if host_name else model
        adapter = expert_adapters_of(host)
        if adapter is None or pname not in adapter:
            raise KeyError(f"import_hf_adapter: {full!r} has no expert adapter (apply=False needs one)")
        ad = adapter[pname]
        assert isinstance(ad, ExpertLoRA)
        if set(parts) != {"lora_A.weight", "lora_B.weight"}:
            raise KeyError(f"import_hf_adapter: {full!r}: expected lora_A and lora_B, got {sorted(parts)}")
        e = ad.num_experts
        a_hf, b_hf = parts["lora_A.weight"], parts["lora_B.weight"]  # [E*r, in], [out, r*E]
        copy_into(ad.lora_A, a_hf.reshape(e, -1, a_hf.shape[-1]), name=f"{full} lora_A")
        b = b_hf.reshape(b_hf.shape[0], -1, e).permute(2, 0, 1)  # [E, out, r] in HF's row order
        order = _out_order(expert_out_order, full, b.shape[1])
        if order is not None:
            b = b[:, torch.argsort(order)]
        copy_into(ad.lora_B, b, name=f"{full} lora_B")
