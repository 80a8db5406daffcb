"""PEFT method configurations: one frozen pydantic model per method, a discriminated union, a stack.

Targets are regular expressions matched with :func:`re.fullmatch` against qualified names as
:meth:`torch.nn.Module.named_modules` / ``named_parameters`` print them *before* injection (so a
``FullTuneConfig`` written for the base model keeps matching after LoRA renamed ``q_proj.weight``
to ``q_proj.base_layer.weight``). A list of strings instead of a regex follows Hugging Face PEFT's
list semantics: a module matches when its name equals an entry or ends with ``"." + entry``.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = [
    "DoRAConfig",
    "FullTuneConfig",
    "LoRAConfig",
    "LoRAInit",
    "PeftConfig",
    "PeftStackConfig",
    "Targets",
    "matches",
]

LoRAInit = Literal["kaiming", "gaussian", "pissa", "random"]
"""Adapter initialisation.

``kaiming``: A ~ Kaiming-uniform(a=sqrt(5)) (``nn.Linear``'s default), B = 0 (HF ``init_lora_weights=True``).
``gaussian``: A ~ N(0, 1/r), B = 0 (HF ``"gaussian"``).
``pissa``: A, B from the top-r SVD of the base weight, which keeps the residual (HF ``"pissa"``);
it rewrites the base weight, see the README.
``random``: A and B both Kaiming-uniform, so the adapter is non-zero from the start (HF
``init_lora_weights=False``); for tests and for loading trained weights over it.
"""

Targets = str | list[str]


def _check_targets(value: Targets, field: str) -> Targets:
    if isinstance(value, str):
        try:
            re.compile(value)
        except re.error as exc:
            raise ValueError(f"{field}: invalid regular expression {value!r}: {exc}") from exc
    elif not value:
        raise ValueError(f"{field}: an empty list targets nothing")
    return value


def matches(targets: Targets | None, name: str) -> bool:
    """Whether a qualified module/parameter ``name`` is selected by ``targets``.

    Args:
        targets: a regex (``re.fullmatch``), a list of names/suffixes (HF PEFT list semantics) or None.
        name: qualified name, e.g. ``"model.layers.0.self_attn.q_proj"``.
    """
    if targets is None:
        return False
    if isinstance(targets, str):
        return re.fullmatch(targets, name) is not None
    return any(name == t or name.endswith("." + t) for t in targets)


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class _LowRankFields(_Frozen):
    r: int = Field(8, gt=0, description="adapter rank")
    alpha: float = Field(
        16.0, gt=0, description="scaling numerator: scaling = alpha / r (alpha / sqrt(r) with rsLoRA)"
    )
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="dropout on the adapter input")
    use_rslora: bool = Field(False, description="rank-stabilised scaling alpha / sqrt(r)")
    init: LoRAInit = "kaiming"
    target_modules: Targets | None = Field(
        None, description="nn.Linear modules to adapt (regex fullmatch, or HF-style list of suffixes)"
    )

    @field_validator("target_modules")
    @classmethod
    def _valid_modules(cls, v: Targets | None) -> Targets | None:
        return None if v is None else _check_targets(v, "target_modules")

    @property
    def scaling(self) -> float:
        """The factor applied to ``B @ A``."""
        return self.alpha / (self.r**0.5 if self.use_rslora else self.r)


class LoRAConfig(_LowRankFields):
    r"""Low-rank adapters ``W x + scaling * B A dropout(x)`` on linear layers and grouped experts.

    Example:
        ``LoRAConfig(r=16, alpha=32, target_modules=r".*\.(q|k|v|o)_proj",
        target_parameters=r".*\.experts\.(gate_up_proj|down_proj)")``
    """

    method: Literal["lora"] = "lora"
    target_parameters: Targets | None = Field(
        None,
        description="3-D grouped-expert weights [E, out, in] to adapt per expert (regex fullmatch over parameter names)",
    )

    @field_validator("target_parameters")
    @classmethod
    def _valid_params(cls, v: Targets | None) -> Targets | None:
        return None if v is None else _check_targets(v, "target_parameters")

    @model_validator(mode="after")
    def _targets_something(self) -> LoRAConfig:
        if self.target_modules is None and self.target_parameters is None:
            raise ValueError("LoRAConfig: set target_modules and/or target_parameters")
        return self


class DoRAConfig(_LowRankFields):
    """Weight-decomposed LoRA (DoRA) on linear layers: ``m * (W + s B A) / ||W + s B A||_row``.

    The row norm is treated as a constant in backward (DoRA paper section 4.3, as HF PEFT does).
    """

    method: Literal["dora"] = "dora"

    @model_validator(mode="after")
    def _targets_something(self) -> DoRAConfig:
        if self.target_modules is None:
            raise ValueError("DoRAConfig: target_modules is required")
        if self.init == "pissa":
            raise ValueError("DoRAConfig: init='pissa' is not supported with DoRA")
        return self


class FullTuneConfig(_Frozen):
    """Unfreeze existing parameters whose (pre-injection) names match ``target_parameters``."""

    method: Literal["full"] = "full"
    target_parameters: Targets

    @field_validator("target_parameters")
    @classmethod
    def _valid_params(cls, v: Targets) -> Targets:
        return _check_targets(v, "target_parameters")


PeftConfig = Annotated[LoRAConfig | DoRAConfig | FullTuneConfig, Field(discriminator="method")]
"""One PEFT method; ``method`` selects the variant when validating from a dict/JSON/YAML."""


class PeftStackConfig(_Frozen):
    """Several methods applied in order to one model (e.g. LoRA on attention + full-tune of norms).

    Two adapter methods may not target the same module; :func:`plait.peft.apply_peft` raises naming it.
    """

    methods: list[PeftConfig] = Field(min_length=1)
