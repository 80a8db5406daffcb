"""Load base checkpoints (original key names) into an injected model, through plait.model_state.

LoRA wraps ``q_proj`` as ``q_proj.base_layer``, so the base key ``...q_proj.weight`` lives at
``...q_proj.base_layer.weight`` after :func:`plait.peft.apply_peft`. :func:`base_to_injected`
is a model-state :class:`~plait.model_state.Mapper` doing that rename (compose it after a
checkpoint-format mapper: ``hf_to_plait >> base_to_injected(model)``); grouped-expert adapters
keep the expert weights' names, so they need no rule. :func:`load_base_checkpoint` loads with it
and checks that exactly the adapter parameters were left out.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from plait.model_state import (
    CheckpointReader,
    LoadResult,
    Mapper,
    MapperGroup,
    TensorSpec,
    is_meta,
    load_module,
)
from plait.model_state.errors import KeyMismatchError
from plait.peft.apply import expert_adapters, linear_adapters
from torch import nn

__all__ = ["BaseKeyRename", "adapter_keys", "base_to_injected", "load_base_checkpoint"]


class BaseKeyRename(Mapper):
    """Exact renames ``{original key: injected key}`` (dict lookup per key; other keys pass through)."""

    def __init__(self, renames: Mapping[str, str]) -> None:
        self.renames = dict(renames)

    def groups(self, source: Mapping[str, TensorSpec]) -> list[MapperGroup]:
        return [
            MapperGroup.rename(k, self.renames[k], spec, label="peft.base_layer")
            for k, spec in source.items()
            if k in self.renames
        ]

    def inverse(self) -> Mapper:
        return BaseKeyRename({v: k for k, v in self.renames.items()})

    def __repr__(self) -> str:
        return f"BaseKeyRename({len(self.renames)} keys)"


def base_to_injected(model: nn.Module) -> BaseKeyRename:
    """The mapper from the base model's state-dict keys to ``model``'s (after :func:`apply_peft`).

    Its :meth:`~BaseKeyRename.inverse` maps back (e.g. to save a merged base under original names).
    """
    renames: dict[str, str] = {}
    for name, mod in linear_adapters(model):
        prefix = f"{name}." if name else ""
        for pname in mod.base_layer.state_dict(keep_vars=True):
            renames[f"{prefix}{pname}"] = f"{prefix}base_layer.{pname}"
    return BaseKeyRename(renames)


def adapter_keys(model: nn.Module) -> set[str]:
    """State-dict keys that belong to adapters (not present in a base checkpoint)."""
    keys: set[str] = set()
    for name, mod in linear_adapters(model):
        prefix = f"{name}." if name else ""
        keys |= {f"{prefix}{k}" for k in mod.state_dict(keep_vars=True) if not k.startswith("base_layer.")}
    names = {module: name for name, module in model.named_modules()}
    for _, _, adapter in expert_adapters(model):
        keys |= {f"{names[adapter]}.{k}" for k in adapter.state_dict(keep_vars=True)}
    return keys


def load_base_checkpoint(
    model: nn.Module,
    source: str | os.PathLike[str] | CheckpointReader,
    mapper: Mapper | None = None,
    *,
    allow_cast: bool = False,
    reinit_adapters: bool | None = None,
) -> LoadResult:
    """Load a base-model checkpoint into an injected model (streaming, DTensor-aware).

    Every model key must be produced except the adapters', and nothing unexpected may be left.

    Args:
        model: a model passed through :func:`plait.peft.apply_peft` (possibly on the meta device,
            possibly ``fully_shard``-ed).
        source: checkpoint directory / file / index or an open reader.
        mapper: checkpoint keys -> base model keys (e.g. an HF -> plait mapper); the ``base_layer``
            renames are appended.
        allow_cast: passed to :func:`plait.model_state.load_module`.
        reinit_adapters: re-run the adapters' initialisation after loading (needed when the model
            was on the meta device, and for inits that read the base weight: PiSSA, DoRA's magnitude).
            Default: True when any adapter parameter was on the meta device.

    Returns:
        model-state's :class:`~plait.model_state.LoadResult` (``missing`` = the adapter keys).
    """
    rename = base_to_injected(model)
    full = rename if mapper is None else mapper >> rename
    adapters = adapter_keys(model)
    state = model.state_dict(keep_vars=True)
    was_meta = any(is_meta(state[k]) for k in adapters if k in state)
    result = load_module(model, source, full, strict=False, allow_cast=allow_cast)
    back = {v: k for k, v in rename.renames.items()}  # report base keys under their original names
    missing = sorted(back.get(k, k) for k in set(result.missing) - adapters)
    if missing or result.unexpected:
        raise KeyMismatchError(
            f"load_base_checkpoint: base keys missing {missing[:8]}, unexpected {list(result.unexpected)[:8]}",
            missing,
            result.unexpected,
        )
    if reinit_adapters if reinit_adapters is not None else was_meta:
        for _, mod in linear_adapters(model):
            mod.reset_adapter_parameters()
        for _, host, adapter in expert_adapters(model):
            adapter.reset_adapter_parameters(getattr(host, adapter.param_name))
    return result
