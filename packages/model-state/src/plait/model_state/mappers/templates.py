"""Key templates: ``"model.layers.{i}.mlp.experts.{e}.w1"`` style patterns over dotted keys.

``{name}`` matches one dotted segment (``[^.]+``); ``{*name}`` matches one or more segments
(``.+``). A template without placeholders matches exactly one key.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from ..errors import MapperError

__all__ = ["KeyTemplate"]

_FIELD = re.compile(r"\{(\*?)([A-Za-z_][A-Za-z0-9_]*)\}")


class KeyTemplate:
    """A dotted-key pattern with named placeholders that can match and format keys."""

    def __init__(self, template: str) -> None:
        self.template = template
        parts: list[str] = []
        names: list[str] = []
        pos = 0
        for m in _FIELD.finditer(template):
            parts.append(re.escape(template[pos : m.start()]))
            star, name = m.group(1), m.group(2)
            if name in names:
                raise MapperError(f"key template {template!r} repeats placeholder {{{name}}}")
            names.append(name)
            parts.append(f"(?P<{name}>.+?)" if star else f"(?P<{name}>[^.]+)")
            pos = m.end()
        parts.append(re.escape(template[pos:]))
        leftover = _FIELD.sub("", template)
        if "{" in leftover or "}" in leftover:
            raise MapperError(f"key template {template!r} has a malformed placeholder")
        self.fields: tuple[str, ...] = tuple(names)
        self._regex = re.compile("".join(parts) + r"\Z")

    def match(self, key: str) -> dict[str, str] | None:
        """Placeholder values if ``key`` matches the whole template, else ``None``."""
        m = self._regex.match(key)
        return None if m is None else m.groupdict()

    def format(self, values: Mapping[str, object]) -> str:
        """Fill the placeholders (``{*x}`` and ``{x}`` alike)."""
        missing = [f for f in self.fields if f not in values]
        if missing:
            raise MapperError(f"key template {self.template!r} needs values for {missing}")
        return _FIELD.sub(lambda m: str(values[m.group(2)]), self.template)

    def __repr__(self) -> str:
        return f"KeyTemplate({self.template!r})"


def as_templates(keys: str | KeyTemplate | list[str] | tuple[str, ...]) -> list[KeyTemplate]:
    if isinstance(keys, KeyTemplate):
        return [keys]
    if isinstance(keys, str):
        return [KeyTemplate(keys)]
    return [k if isinstance(k, KeyTemplate) else KeyTemplate(k) for k in keys]


def match_any(templates: list[KeyTemplate], key: str) -> dict[str, str] | None:
    for t in templates:
        m = t.match(key)
        if m is not None:
            return m
    return None
