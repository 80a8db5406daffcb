"""Inject PEFT methods into a model, merge/unmerge them, and list what is trainable.

Methods are looked up by their config's ``method`` string in a small registry, so a user can plug
in a variant with :func:`register_peft_method` and pass its config to :func:`apply_peft` directly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from plait.peft.config import DoRAConfig, FullTuneConfig, LoRAConfig, PeftStackConfig, matches
from plait.peft.experts import (
    ExpertAdapterHost,
    ExpertLoRA,
    attach_expert_adapter,
    detach_expert_adapters,
    expert_adapters_of,
)
from plait.peft.lora import DoRALinear, LoRALinear
from torch import nn

__all__ = [
    "AdaptedModule",
    "PeftApplier",
    "PeftReport",
    "apply_peft",
    "canonical_name",
    "expert_adapters",
    "linear_adapters",
    "merge_and_unload",
    "merge_peft",
    "register_peft_method",
    "shard_expert_adapters",
    "trainable_parameters",
    "unmerge_peft",
]


@dataclass(frozen=True)
class AdaptedModule:
    """One injected adapter.

    Attributes:
        name: qualified name of the adapted module (``"layers.0.q_proj"``) or, for grouped
            experts, of the adapted parameter (``"layers.0.mlp.experts.gate_up_proj"``).
        method: ``"lora"``, ``"dora"`` or ``"lora_experts"``.
    """

    name: str
    method: str


@dataclass(frozen=True)
class PeftReport:
    """What :func:`apply_peft` did.

    Attributes:
        adapted: injected adapters, in model order per method.
        full_tuned: (post-injection) names of unfrozen existing parameters.
        trainable: names of all parameters with ``requires_grad`` afterwards.
        num_trainable: their element count.
        num_total: element count of all parameters.
    """

    adapted: tuple[AdaptedModule, ...]
    full_tuned: tuple[str, ...]
    trainable: tuple[str, ...]
    num_trainable: int
    num_total: int


PeftApplier = Callable[[nn.Module, Any], "list[AdaptedModule] | list[str]"]
"""``applier(model, config)`` injects/unfreezes and returns the AdaptedModules (or unfrozen names)."""

_METHODS: dict[str, PeftApplier] = {}


def register_peft_method(method: str, applier: PeftApplier) -> None:
    """Register ``applier`` for configs whose ``method`` field equals ``method``.

    The applier runs after everything was frozen; it must set ``requires_grad`` on what it trains.
    """
    _METHODS[method] = applier


def canonical_name(name: str) -> str:
    """A parameter/module name as it was before LoRA injection (drops ``.base_layer``)."""
    return ".".join(part for part in name.split(".") if part != "base_layer")


def _walk(module: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module, nn.Module | None, str]]:
    """(name, module, parent, attr) for the model's modules, not descending into adapters."""
    stack: list[tuple[str, nn.Module, nn.Module | None, str]] = [(prefix, module, None, "")]
    while stack:
        name, mod, parent, attr = stack.pop()
        yield name, mod, parent, attr
        if isinstance(mod, (LoRALinear, ExpertLoRA)):
            continue
        held = expert_adapters_of(mod)
        children = [
            (f"{name}.{k}" if name else k, child, mod, k)
            for k, child in mod._modules.items()
            if child is not None and child is not held
        ]
        stack.extend(reversed(children))


def linear_adapters(model: nn.Module) -> Iterator[tuple[str, LoRALinear]]:
    """(module name, adapter) for every LoRA/DoRA linear wrapper in ``model``."""
    for name, mod, _, _ in _walk(model):
        if isinstance(mod, LoRALinear):
            yield name, mod


def expert_adapters(model: nn.Module) -> Iterator[tuple[str, nn.Module, ExpertLoRA]]:
    """(module name, host module, adapter) for every grouped-expert adapter in ``model``."""
    for name, mod, _, _ in _walk(model):
        adapters = expert_adapters_of(mod)
        if adapters is not None:
            for adapter in adapters.values():
                if isinstance(adapter, ExpertLoRA):
                    yield name, mod, adapter


def _apply_low_rank(model: nn.Module, cfg: LoRAConfig | DoRAConfig) -> list[AdaptedModule]:
    cls = DoRALinear if isinstance(cfg, DoRAConfig) else LoRALinear
    kwargs: dict[str, Any] = {
        "r": cfg.r,
        "alpha": cfg.alpha,
        "dropout": cfg.dropout,
        "use_rslora": cfg.use_rslora,
        "init": cfg.init,
    }
    done: list[AdaptedModule] = []
    if cfg.target_modules is not None:
        hits = [
            w for w in _walk(model) if w[2] is not None and matches(cfg.target_modules, canonical_name(w[0]))
        ]
        for name, mod, parent, attr in hits:
            if isinstance(mod, LoRALinear):
                raise ValueError(f"{cfg.method}: module {name!r} is already adapted by {type(mod).__name__}")
            if type(mod) is not nn.Linear:
                raise ValueError(
                    f"{cfg.method}: target_modules matched {name!r} of type {type(mod).__name__}; "
                    "only nn.Linear is supported (use target_parameters for grouped experts)"
                )
            assert parent is not None
            setattr(parent, attr, cls(mod, **kwargs))
            done.append(AdaptedModule(name, cfg.method))
        if not hits:
            raise ValueError(f"{cfg.method}: target_modules={cfg.target_modules!r} matched no module")
    if isinstance(cfg, LoRAConfig) and cfg.target_parameters is not None:
        n_before = len(done)
        for host_name, host, _, _ in list(_walk(model)):
            for pname, param in list(host._parameters.items()):
                full = f"{host_name}.{pname}" if host_name else pname
                if param is None or not matches(cfg.target_parameters, canonical_name(full)):
                    continue
                if param.ndim != 3:
                    raise ValueError(
                        f"lora: target_parameters matched {full!r} with shape {tuple(param.shape)}; "
                        "grouped-expert LoRA needs a 3-D [E, out, in] weight"
                    )
                adapters = expert_adapters_of(host)
                if adapters is not None and pname in adapters:
                    raise ValueError(f"lora: parameter {full!r} is already adapted")
                try:
                    attach_expert_adapter(host, pname, ExpertLoRA(param, pname, **kwargs))
                except ValueError as e:
                    raise ValueError(f"{e} (at {host_name!r})") from None
                done.append(AdaptedModule(full, "lora_experts"))
        if len(done) == n_before:
            raise ValueError(f"lora: target_parameters={cfg.target_parameters!r} matched no parameter")
    # new adapter parameters are created with requires_grad=True; base weights stay as they were
    return done


def _apply_full(model: nn.Module, cfg: FullTuneConfig) -> list[str]:
    names = [n for n, p in model.named_parameters() if matches(cfg.target_parameters, canonical_name(n))]
    if not names:
        raise ValueError(f"full: target_parameters={cfg.target_parameters!r} matched no parameter")
    params = dict(model.named_parameters())
    for n in names:
        params[n].requires_grad_(True)
    return names


register_peft_method("lora", _apply_low_rank)
register_peft_method("dora", _apply_low_rank)
register_peft_method("full", _apply_full)


def _check_expert_hosts(model: nn.Module, cfg: LoRAConfig) -> None:
    for host_name, host, _, _ in _walk(model):
        for pname, param in host._parameters.items():
            full = f"{host_name}.{pname}" if host_name else pname
            if param is None or param.ndim != 3 or not matches(cfg.target_parameters, canonical_name(full)):
                continue  # non-3-D matches get their own error from the applier
            if not isinstance(host, ExpertAdapterHost):
                raise ValueError(
                    f"lora: target_parameters matched {full!r}, but {type(host).__name__} does not implement "
                    "plait.peft.ExpertAdapterHost (adapters, attach_adapter, detach_adapters), i.e. its "
                    "forward may not call the expert adapters (training would silently ignore them; see "
                    "plait.peft's README). Pass require_expert_hook=False to inject anyway (e.g. to merge "
                    "into the weights)."
                )


def apply_peft(model: nn.Module, config: Any, *, require_expert_hook: bool = True) -> PeftReport:
    """Freeze ``model`` and inject/unfreeze what ``config`` asks for, in place.

    Apply before sharding (``fully_shard``/TP/EP) and after loading or materialising the base
    weights if an init reads them (PiSSA, DoRA's magnitude); on a meta-device model call
    :meth:`reset_adapter_parameters` on each adapter after ``to_empty``.

    Args:
        model: any ``nn.Module``.
        config: a :data:`plait.peft.PeftConfig`, a :class:`plait.peft.PeftStackConfig`, a list of
            configs, or a user config registered with :func:`register_peft_method`.
        require_expert_hook: grouped-expert targets must live on modules that implement
            :class:`plait.peft.ExpertAdapterHost` (as plait.moe's ``GroupedExperts`` does), whose
            forward calls the adapters. Off: inject anyway (merge-only use, foreign modules).

    Returns:
        A :class:`PeftReport`.
    """
    if isinstance(config, PeftStackConfig):
        configs: Sequence[Any] = config.methods
    elif isinstance(config, (list, tuple)):
        configs = config
    else:
        configs = [config]
    if require_expert_hook:
        for cfg in configs:
            if isinstance(cfg, LoRAConfig) and cfg.target_parameters is not None:
                _check_expert_hosts(model, cfg)
    for p in model.parameters():
        p.requires_grad_(False)
    adapted: list[AdaptedModule] = []
    full: list[str] = []
    for cfg in configs:
        method = getattr(cfg, "method", None)
        if method not in _METHODS:
            raise ValueError(f"apply_peft: unknown PEFT method {method!r}; registered: {sorted(_METHODS)}")
        for item in _METHODS[method](model, cfg):
            (adapted if isinstance(item, AdaptedModule) else full).append(item)  # type: ignore[arg-type]
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return PeftReport(
        adapted=tuple(adapted),
        full_tuned=tuple(full),
        trainable=tuple(n for n, _ in trainable),
        num_trainable=sum(p.numel() for _, p in trainable),
        num_total=sum(p.numel() for p in model.parameters()),
    )


def trainable_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """Parameters with ``requires_grad`` (the adapter state), by name."""
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def merge_peft(model: nn.Module, keep_original: bool = False) -> int:
    """Merge every adapter into its base weight; returns how many were merged.

    A collective on DTensor (FSDP2/TP/EP) models: call on every rank, with parameters resharded.

    Args:
        model: a model passed through :func:`apply_peft`.
        keep_original: keep copies of the base weights so :func:`unmerge_peft` is bit-exact.
    """
    n = 0
    for _, mod in linear_adapters(model):
        mod.merge(keep_original=keep_original)
        n += 1
    for _, host, adapter in expert_adapters(model):
        adapter.merge(getattr(host, adapter.param_name), keep_original=keep_original)
        n += 1
    return n


def unmerge_peft(model: nn.Module) -> int:
    """Undo :func:`merge_peft`; returns how many adapters were unmerged."""
    n = 0
    for _, mod in linear_adapters(model):
        mod.unmerge()
        n += 1
    for _, host, adapter in expert_adapters(model):
        adapter.unmerge(getattr(host, adapter.param_name))
        n += 1
    return n


def shard_expert_adapters(model: nn.Module) -> int:
    """Lay out each grouped-expert adapter like its (already sharded) expert weight.

    Call after expert parallelism turned the expert weights into DTensors (e.g. ``Shard(0)`` over
    the EP mesh): ``lora_A``/``lora_B`` become DTensors on the same mesh, sharded on the expert dim
    where the weight is (other weight dims map to ``Replicate``), so each rank's adapter holds
    exactly its local experts. No communication: every rank holds the whole adapter before.

    Returns:
        How many adapters were sharded (weights that are not DTensors are skipped).
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard

    n = 0
    for _, host, adapter in expert_adapters(model):
        weight = getattr(host, adapter.param_name)
        if not isinstance(weight, DTensor):
            continue
        mesh = weight.device_mesh
        placements = [Shard(0) if type(p) is Shard and p.dim == 0 else Replicate() for p in weight.placements]
        for pname in ("lora_A", "lora_B"):
            old = getattr(adapter, pname)
            if isinstance(old, DTensor):
                raise ValueError(f"shard_expert_adapters: {adapter.param_name}.{pname} is already a DTensor")
            full = old.detach().to(weight.to_local().device)
            dt = DTensor.from_local(full, mesh, [Replicate()] * mesh.ndim, run_check=False).redistribute(
                mesh, placements
            )
            setattr(adapter, pname, nn.Parameter(dt, requires_grad=old.requires_grad))
        n += 1
    return n


def merge_and_unload(model: nn.Module) -> nn.Module:
    """Merge all adapters and remove them, leaving the original module structure and key names."""
    merge_peft(model)
    for name, mod in list(linear_adapters(model)):
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, mod.base_layer)
    for _, host, _ in list(expert_adapters(model)):
        detach_expert_adapters(host)
    return model
