"""The config reference, generated from the config classes: every section and key with its type, default
and description (``plait config``, and the docs' config reference page)."""

from __future__ import annotations

import json
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

__all__ = ["Key", "keys", "render_markdown", "render_text", "type_name"]


@dataclass(frozen=True)
class Key:
    """One config key: its dotted name, type, default (as TOML would write it) and description."""

    name: str
    type: str
    default: str
    description: str


def type_name(tp: Any) -> str:
    """A short readable name of a field's type (``int | None``, ``'auto' | 'cpu'``, ``list[str]``)."""
    origin, args = get_origin(tp), get_args(tp)
    if origin is Annotated:
        return type_name(args[0])
    if origin is Literal:
        # sorted: equal Literals in unions are one cached object, in the order of whichever was made first
        return " | ".join(sorted(repr(a) for a in args))
    if origin is Union or origin is types.UnionType:
        return " | ".join(type_name(a) for a in args)
    if tp is type(None):
        return "None"
    if origin is not None:
        inner = ", ".join("..." if a is Ellipsis else type_name(a) for a in args)
        return f"{getattr(origin, '__name__', str(origin))}[{inner}]"
    return getattr(tp, "__name__", str(tp).replace("typing.", ""))


def _default(field: FieldInfo) -> str:
    if field.default is PydanticUndefined:
        return "(required)" if field.default_factory is None else "(computed)"
    value = field.default
    if isinstance(value, BaseModel):
        return "(section)"
    try:
        return json.dumps(value)
    except TypeError:
        return repr(value)


def _sections(tp: Any) -> list[type[BaseModel]]:
    """The config classes a field's type holds (several for a union of variants)."""
    origin, args = get_origin(tp), get_args(tp)
    if origin is Annotated:
        return _sections(args[0])
    if origin is Union or origin is types.UnionType:
        return [s for a in args for s in _sections(a)]
    return [tp] if isinstance(tp, type) and issubclass(tp, BaseModel) else []


def _elements(tp: Any) -> list[type[BaseModel]]:
    """The config classes of a list or tuple field's items (``[[tables]]`` in TOML)."""
    origin, args = get_origin(tp), get_args(tp)
    if origin is Annotated or origin is Union or origin is types.UnionType:
        return [s for a in args for s in _elements(a)]
    if origin in (list, tuple):
        return [s for a in args if a is not Ellipsis for s in _sections(a)]
    return []


def _summary(cls: type[BaseModel]) -> str:
    return (cls.__doc__ or "").strip().split("\n\n")[0].replace("\n", " ")


def keys(cls: type[BaseModel], prefix: str = "") -> Iterator[Key]:
    """Every key of ``cls``, depth first; a section of several variants (e.g. ``optimizer``) lists each
    variant's keys once; the keys of a list of tables (``lr_schedule.segments``) as ``segments[].key``."""
    seen: set[str] = set()
    for name, field in cls.model_fields.items():
        dotted = f"{prefix}{name}"
        sections = _sections(field.annotation)
        if sections:
            yield Key(dotted, " | ".join(s.__name__ for s in sections), "(section)", _summary(sections[0]))
            for section in sections:
                for key in keys(section, f"{dotted}."):
                    if key.name not in seen:
                        seen.add(key.name)
                        yield key
            continue
        yield Key(dotted, type_name(field.annotation), _default(field), (field.description or "").strip())
        for element in _elements(field.annotation):
            for key in keys(element, f"{dotted}[]."):
                if key.name not in seen:
                    seen.add(key.name)
                    yield key


def render_text(cls: type[BaseModel]) -> str:
    """The keys as aligned text, one line each (``plait config --keys``)."""
    rows = list(keys(cls))
    width = max(len(k.name) for k in rows)
    lines = []
    for k in rows:
        lines.append(f"{k.name:<{width}}  {k.type} = {k.default}")
        if k.description:
            lines.append(f"{'':<{width}}    {k.description}")
    return "\n".join(lines)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_markdown(cls: type[BaseModel], model_classes: dict[str, type[BaseModel]]) -> str:
    """The config reference page: every section and key of ``cls``, then each model family's ``[model]``
    keys (``model_classes``: ``model_type`` -> its config class)."""
    out = [
        "# Config reference",
        "",
        "Generated from the config classes by `plait config --markdown` (do not edit by hand). Every key is",
        "set in a TOML/YAML/JSON file (`[section]` tables) or on the command line as `--section.key=value`",
        "(a key outside the sections as `--key=value`, e.g. `--model_dtype=bfloat16`);",
        "`plait config [--config F] [--section.key=value ...]` prints the resolved values.",
        "",
    ]
    section = ""
    for k in keys(cls):
        top = k.name.split(".")[0]
        if top != section:
            section = top
            out += ["", f"## `{top}`", ""]
            if k.name == top and k.description:
                out += [k.description, ""]
            out += ["| key | type | default | description |", "|---|---|---|---|"]
        if k.name == top and k.default == "(section)":
            continue
        out.append(f"| `{k.name}` | {_cell(k.type)} | `{_cell(k.default)}` | {_cell(k.description)} |")
    out += [
        "",
        "## `model` (by family)",
        "",
        "`[model] model_type` picks the family; the other keys are that family's Hugging Face",
        "`config.json` fields (with `--init-from HF_DIR` they come from the checkpoint).",
    ]
    for model_type, model_cls in sorted(model_classes.items()):
        out += ["", f'### `model_type = "{model_type}"`', "", "| key | type | default |", "|---|---|---|"]
        out += [f"| `model.{k.name}` | {_cell(k.type)} | `{_cell(k.default)}` |" for k in keys(model_cls)]
    return "\n".join(out) + "\n"
