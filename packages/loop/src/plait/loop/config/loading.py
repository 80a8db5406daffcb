"""Loading a config from TOML, YAML or JSON, dotted command-line overrides and JSON-schema export."""

from __future__ import annotations

import difflib
import json
import tomllib
import types
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar, Union, get_args, get_origin

from plait.loop.config.sections import OPTIMIZER_NAMES
from plait.loop.config.trainer_config import TrainerConfig
from pydantic import BaseModel, ValidationError

__all__ = [
    "ConfigError",
    "apply_overrides",
    "config_json_schema",
    "dump_config",
    "load_config",
    "nearest_key",
    "parse_override",
    "read_config_file",
    "split_cli_overrides",
]

C = TypeVar("C", bound=BaseModel)


class ConfigError(ValueError):
    """A config that does not parse or validate; the message names each bad field and value."""


def read_config_file(path: str | Path) -> dict[str, Any]:
    """Read a ``.toml``, ``.yaml``/``.yml`` or ``.json`` file into a plain dict.

    Raises:
        ConfigError: a missing or unreadable file, unknown suffix, unparsable file, or a top level
            that is not a table.
        ImportError: a YAML file without pyyaml (``pip install 'plait-loop[yaml]'``).
    """
    path = Path(path)
    suffix = path.suffix.lower()
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except OSError as e:
        raise ConfigError(f"config file {path} cannot be read: {e.strerror or e}") from None
    try:
        if suffix == ".toml":
            data: Any = tomllib.loads(text)
        elif suffix in (".yaml", ".yml"):
            try:
                import yaml
            except ImportError as e:  # pragma: no cover - pyyaml is present in dev envs
                raise ImportError(f"reading {path} needs pyyaml: pip install 'plait-loop[yaml]'") from e
            data = yaml.safe_load(text) or {}
        elif suffix == ".json":
            data = json.loads(text)
        else:
            raise ConfigError(f"{path}: unknown config format {suffix!r} (use .toml, .yaml, .yml or .json)")
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: cannot parse: {e}") from e
    except Exception as e:
        if type(e).__module__.startswith("yaml"):
            raise ConfigError(f"{path}: cannot parse: {e}") from e
        raise
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a table/mapping, got {type(data).__name__}")
    return data


def _parse_value(text: str) -> Any:
    # JSON covers numbers, booleans, null, lists and objects; anything else stays a string and
    # pydantic coerces it to the field's type.
    lowered = {"true": True, "false": False, "none": None, "null": None}
    if text.lower() in lowered:
        return lowered[text.lower()]
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _split(item: str) -> tuple[list[str], str]:
    body = item[2:] if item.startswith("--") else item
    key, sep, value = body.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"bad override {item!r}: expected --section.field=value")
    return key.split("."), value


def parse_override(item: str, cls: type[BaseModel] | None = None) -> tuple[list[str], Any]:
    """``"--optimizer.lr=3e-4"`` -> ``(["optimizer", "lr"], 3e-4)``.

    With ``cls`` the value is read by the type of the field it sets: a field that takes strings
    keeps the text as it is (``--run.name=2024`` is the name ``"2024"``; ``none``/``null`` is None
    where the field also takes None); other fields (numbers, booleans, lists) decode it as JSON.
    Without ``cls``, or for a key the config does not declare, the value is JSON-decoded when it
    parses and kept as text otherwise.

    Raises:
        ConfigError: when there is no ``=`` or the key is empty.
    """
    path, text = _split(item)
    targets = _field_types(cls, path) if cls is not None else []
    members = [m for t in targets for m in _members(t)]
    if members and Any not in members and any(_takes_str(m) for m in members):
        if text.lower() in ("none", "null") and type(None) in members:
            return path, None
        return path, text
    return path, _parse_value(text)


def _members(tp: Any) -> list[Any]:
    """The alternatives of a (possibly Annotated / Optional / Union) type."""
    origin = get_origin(tp)
    if origin is Annotated:
        return _members(get_args(tp)[0])
    if origin is Union or origin is types.UnionType:
        return [m for a in get_args(tp) for m in _members(a)]
    return [tp]


def _takes_str(tp: Any) -> bool:
    return tp is str or (get_origin(tp) is Literal and any(isinstance(a, str) for a in get_args(tp)))


def _field_types(cls: type[BaseModel], path: Sequence[str]) -> list[Any]:
    """The declared types a dotted ``path`` may point to in ``cls`` (several through unions); [] if unknown."""
    current: list[Any] = [cls]
    for part in path:
        found: list[Any] = []
        for tp in current:
            for m in _members(tp):
                origin, args = get_origin(m), get_args(m)
                if isinstance(m, type) and issubclass(m, BaseModel):
                    if (field := m.model_fields.get(part)) is not None:
                        found.append(field.annotation)
                elif origin in (list, tuple) and args and part.lstrip("-").isdigit():
                    found.append(
                        args[0] if origin is list or args[-1] is Ellipsis else args[int(part) % len(args)]
                    )
                elif origin is dict and len(args) == 2:
                    found.append(args[1])
                elif m is Any or m is dict:
                    found.append(Any)
        current = found
    return current


def apply_overrides(
    data: dict[str, Any],
    overrides: Sequence[str],
    defaults: Mapping[str, Any] | None = None,
    cls: type[BaseModel] | None = None,
) -> dict[str, Any]:
    """Return a copy of ``data`` with dotted overrides applied (lists are indexed by integers).

    ``defaults`` (the dumped config without overrides) supplies lists that ``data`` does not spell
    out, so ``--logging.trackers.0.kind=console`` edits the default tracker list. ``cls`` (the
    config class) reads each value by the type of its field (see :func:`parse_override`).
    """
    out = json.loads(json.dumps(data))  # deep copy of plain data
    for item in overrides:
        path, value = parse_override(item, cls)
        node: Any = out
        dnode: Any = defaults or {}
        for i, part in enumerate(path[:-1]):
            if isinstance(node, list):
                idx = _index(part, node, item)
                node = node[idx]
                dnode = dnode[idx] if isinstance(dnode, list) and idx < len(dnode) else {}
                continue
            nxt = node.get(part)
            dnext = dnode.get(part) if isinstance(dnode, dict) else None
            if nxt is None:
                # Copy a default list only when the override indexes into it.
                is_index = path[i + 1].lstrip("-").isdigit()
                nxt = json.loads(json.dumps(dnext)) if is_index and isinstance(dnext, list) else {}
                node[part] = nxt
            elif not isinstance(nxt, dict | list):
                raise ConfigError(f"override {item!r}: {'.'.join(path[: i + 1])} is a value, not a section")
            dnode = dnext
            node = nxt
        last = path[-1]
        if isinstance(node, list):
            node[_index(last, node, item)] = value
        else:
            node[last] = value
    return out


def _index(part: str, node: list[Any], item: str) -> int:
    try:
        idx = int(part)
        node[idx]
    except (ValueError, IndexError):
        raise ConfigError(f"override {item!r}: {part!r} is not an index of a list of {len(node)}") from None
    return idx


REFERENCE_HINT = "every key: `plait config`, or the config reference of the docs"


def nearest_key(name: str, known: Iterable[str], prefix: str = "") -> str:
    """``"; did you mean `PREFIX.KEY`?"`` for the known key nearest to ``name`` (a misspelling), else ``""``;
    either way followed by where every key is listed."""
    match = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return (f"; did you mean `{prefix}{match[0]}`?" if match else "") + f" ({REFERENCE_HINT})"


def _known_keys(cls: type[BaseModel] | None, path: Sequence[str]) -> list[str]:
    """The keys of the section(s) at ``path`` of ``cls`` (several through unions)."""
    if cls is None:
        return []
    sections = [m for t in _field_types(cls, path) for m in _members(t)] if path else [cls]
    return [k for m in sections if isinstance(m, type) and issubclass(m, BaseModel) for k in m.model_fields]


def _format_errors(err: ValidationError, source: str, cls: type[BaseModel] | None = None) -> str:
    lines = [f"invalid config ({source}):"]
    for e in err.errors():
        parts = [str(p) for p in e["loc"]]
        # Drop the tag pydantic inserts for tagged unions (optimizer.adamw.lr -> optimizer.lr).
        parts = [
            p
            for i, p in enumerate(parts)
            if not (i > 0 and parts[i - 1] == "optimizer" and p in OPTIMIZER_NAMES)
        ]
        loc = ".".join(parts)
        value = e.get("input")
        shown = repr(value) if not isinstance(value, dict) else "{...}"
        if e["type"] == "extra_forbidden" and parts:
            prefix = ".".join(parts[:-1]) + "." if len(parts) > 1 else ""
            hint = nearest_key(parts[-1], _known_keys(cls, parts[:-1]), prefix)
            lines.append(f"  {loc}: unknown key (got {shown}){hint}")
        elif loc and str(e["msg"]).removeprefix("Value error, ").startswith(f"{loc}."):
            lines.append(
                f"  {str(e['msg']).removeprefix('Value error, ')}"
            )  # a section's own check names its keys
        elif loc:
            lines.append(f"  {loc}: {e['msg']} (got {shown})")
        else:  # a cross-field check: its message names the fields itself
            lines.append(f"  {e['msg'].removeprefix('Value error, ')}")
    return "\n".join(lines)


def load_config(
    path: str | Path | None = None,
    overrides: Sequence[str] = (),
    *,
    cls: type[C] = TrainerConfig,  # type: ignore[assignment]
    base: Mapping[str, Any] | None = None,
) -> C:
    """Build a config from defaults, an optional file and dotted overrides (applied in that order).

    Args:
        path: a TOML, YAML or JSON file, or None for the defaults (and ``base``).
        overrides: items like ``"--optimizer.lr=3e-4"`` or ``"run.steps=10"``.
        cls: the config class (a subclass of TrainerConfig, or any pydantic model).
        base: data under the file (e.g. a script's embedded defaults).

    Raises:
        ConfigError: naming each bad field and the value it got.
    """
    data: dict[str, Any] = json.loads(json.dumps(dict(base or {})))
    source = "defaults"
    if path is not None:
        data = _merge(data, read_config_file(path))
        source = str(path)
    if overrides:
        try:
            defaults: dict[str, Any] | None = cls.model_validate(data).model_dump(mode="json")
        except ValidationError:
            defaults = None
        data = apply_overrides(data, overrides, defaults, cls)
        source += " + overrides " + " ".join(overrides)
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_errors(e, source, cls)) from None


def _merge(base: dict[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in top.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


def split_cli_overrides(
    argv: Sequence[str], cls: type[BaseModel] | None = None
) -> tuple[list[str], list[str]]:
    """Split ``argv`` into overrides and the remaining arguments: dotted ones (``--a.b=v``) and, with
    ``cls``, ``--key=v`` for a top-level field ``key`` of ``cls`` (``--model_dtype=bfloat16``)."""
    overrides: list[str] = []
    rest: list[str] = []
    top = set(cls.model_fields) if cls is not None else set()
    for arg in argv:
        key = arg[2:].partition("=")[0] if arg.startswith("--") else ""
        (overrides if ("." in key or key in top) and "=" in arg else rest).append(arg)
    return overrides, rest


def config_json_schema(
    cls: type[BaseModel] = TrainerConfig, path: str | Path | None = None
) -> dict[str, Any]:
    """The config's JSON schema (written to ``path`` when given)."""
    schema = cls.model_json_schema()
    if path is not None:
        Path(path).write_text(json.dumps(schema, indent=2))
    return schema


def dump_config(config: BaseModel, path: str | Path) -> None:
    """Write a config as JSON or YAML (by suffix); it loads back with :func:`load_config`."""
    path = Path(path)
    data = config.model_dump(mode="json")
    if path.suffix.lower() in (".yaml", ".yml"):
        import yaml

        path.write_text(yaml.safe_dump(data, sort_keys=False))
    else:
        path.write_text(json.dumps(data, indent=2))
