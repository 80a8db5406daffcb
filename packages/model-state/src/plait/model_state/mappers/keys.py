"""Key-only mappers: identity, rename (exact and template), prefix scopes, drop."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ..errors import MapperError
from ..specs import TensorSpec
from .base import PASS_THROUGH, Mapper, MapperGroup, rekey
from .templates import KeyTemplate, as_templates, match_any

__all__ = ["AddPrefix", "Drop", "Identity", "Rename", "Scoped", "Select"]

Keys = str | Sequence[str]


class Identity(Mapper):
    """Claims the keys matching ``keys`` (default: all) and passes them through unchanged."""

    def __init__(self, keys: Keys = "{*key}") -> None:
        self.templates = as_templates(keys if isinstance(keys, str) else list(keys))

    def groups(self, source: Mapping[str, TensorSpec]) -> list[MapperGroup]:
        return [
            MapperGroup.rename(k, k, s) for k, s in source.items() if match_any(self.templates, k) is not None
        ]

    def inverse(self) -> Mapper:
        return self

    def __repr__(self) -> str:
        return f"Identity({[t.template for t in self.templates]})"


class Rename(Mapper):
    """Renames keys by exact names or templates; the first matching rule wins.

    Example:
        ``Rename({"model.embed_tokens.weight": "embed.weight",
        "model.layers.{i}.self_attn.{p}_proj.weight": "layers.{i}.attn.{p}.weight"})``

    Keys that match no rule pass through unchanged.
    """

    def __init__(self, rules: Mapping[str, str] | Sequence[tuple[str, str]]) -> None:
        items = list(rules.items()) if isinstance(rules, Mapping) else list(rules)
        self.rules: list[tuple[KeyTemplate, KeyTemplate]] = []
        for src, dst in items:
            s, d = KeyTemplate(src), KeyTemplate(dst)
            extra = set(d.fields) - set(s.fields)
            if extra:
                raise MapperError(
                    f"Rename rule {src!r} -> {dst!r}: placeholders {sorted(extra)} not in the source"
                )
            self.rules.append((s, d))

    def groups(self, source: Mapping[str, TensorSpec]) -> list[MapperGroup]:
        out = []
        for k, spec in source.items():
            for s, d in self.rules:
                m = s.match(k)
                if m is not None:
                    out.append(MapperGroup.rename(k, d.format(m), spec, label=f"Rename({s.template!r})"))
                    break
        return out

    def inverse(self) -> Mapper:
        for s, d in self.rules:
            if set(s.fields) != set(d.fields):
                raise MapperError(
                    f"Rename rule {s.template!r} -> {d.template!r} drops placeholders: not invertible"
                )
        return Rename([(d.template, s.template) for s, d in self.rules])

    def __repr__(self) -> str:
        return f"Rename({[(s.template, d.template) for s, d in self.rules]})"


class Select(Mapper):
    """Selects a child scope: keys under ``prefix`` lose the prefix; every other key is dropped.

    ``Select("model.")`` turns ``model.layers.0.w`` into ``layers.0.w`` and drops ``lm_head.weight``.
    """

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix

    def groups(self, source: Mapping[str, TensorSpec]) -> list[MapperGroup]:
        n = len(self.prefix)
        keep = [
            MapperGroup.rename(k, k[n:], s, f"Select({self.prefix!r})")
            for k, s in source.items()
            if k.startswith(self.prefix)
        ]
        dropped = [k for k in source if not k.startswith(self.prefix)]
        return keep + ([MapperGroup.drop(dropped, f"Select({self.prefix!r})")] if dropped else [])

    def inverse(self) -> Mapper:
        return AddPrefix(self.prefix)

    def __repr__(self) -> str:
        return f"Select({self.prefix!r})"


class AddPrefix(Mapper):
    """Prepends ``prefix`` to every key (the inverse of :class:`Select`)."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix

    def groups(self, source: Mapping[str, TensorSpec]) -> list[MapperGroup]:
        return [
            MapperGroup.rename(k, self.prefix + k, s, f"AddPrefix({self.prefix!r})")
            for k, s in source.items()
        ]

    def inverse(self) -> Mapper:
        return Select(self.prefix)

    def __repr__(self) -> str:
        return f"AddPrefix({self.prefix!r})"


class Scoped(Mapper):
    """Applies ``inner`` to the keys under ``prefix`` (seen without the prefix); others pass through.

    ``Scoped("model.layers.3.", m)`` runs ``m`` as if the checkpoint held only layer 3.
    """

    def __init__(self, prefix: str, inner: Mapper) -> None:
        self.prefix = prefix
        self.inner = inner

    def groups(self, source: Mapping[str, TensorSpec]) -> list[MapperGroup]:
        n = len(self.prefix)
        sub = {k[n:]: s for k, s in source.items() if k.startswith(self.prefix)}
        if not sub:
            return []
        plan = self.inner.plan(sub)
        out = []
        for g in plan.groups:
            if g.label == PASS_THROUGH:
                continue  # not claimed: the enclosing plan passes these keys through
            out.append(
                rekey(
                    g,
                    {k: self.prefix + k for k in g.inputs},
                    {k: self.prefix + k for k in g.outputs},
                    f"Scoped({self.prefix!r}, {g.label})",
                )
            )
        return out

    def inverse(self) -> Mapper:
        return Scoped(self.prefix, self.inner.inverse())

    def __repr__(self) -> str:
        return f"Scoped({self.prefix!r}, {self.inner!r})"


class Drop(Mapper):
    """Drops the keys matching any template (they are never read), e.g. ``Drop("{*x}.rotary_emb.inv_freq")``."""

    def __init__(self, *keys: str) -> None:
        self.templates = as_templates(list(keys))

    def groups(self, source: Mapping[str, TensorSpec]) -> list[MapperGroup]:
        hit = [k for k in source if match_any(self.templates, k) is not None]
        return [MapperGroup.drop(hit, f"Drop({[t.template for t in self.templates]})")] if hit else []

    def __repr__(self) -> str:
        return f"Drop({[t.template for t in self.templates]})"
