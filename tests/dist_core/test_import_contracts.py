"""The import contracts state ARCHITECTURE.md's dependency table exactly, a deliberate cross-package
import breaks them (import-linter, as CI runs it), and every wheel declares exactly what it imports."""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]

# ARCHITECTURE.md's dependency table: the plait packages each package may import.
MAY_IMPORT: dict[str, set[str]] = {
    "dist_core": set(),
    "kernels": set(),
    "model_state": set(),
    "pipelining": {"dist_core", "kernels"},
    "moe": {"dist_core", "kernels"},
    "peft": {"model_state"},
    "models": {"dist_core", "kernels", "moe", "model_state", "pipelining"},
    "loop": {"dist_core", "kernels", "pipelining", "model_state"},
    # the meta-package's job layer (plait.train): every member
    "train": {"dist_core", "kernels", "model_state", "pipelining", "moe", "peft", "models", "loop"},
}

# Import names that differ from their distribution's name.
_DISTRIBUTION = {
    "yaml": "pyyaml",
    "cut_cross_entropy": "cut-cross-entropy",
    "grouped_gemm": "nv-grouped-gemm",
    "deep_ep": "deep-ep",
    "flash_attn": "flash-attn",
    "fla": "fla-core",
    "pydantic_core": "pydantic-core",
}
# Calls that import a module given by name (the trackers' _need names an optional module).
_IMPORTING_CALLS = {"import_module", "find_spec", "_need"}


def _importlinter() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]


def _short(module: str) -> str:
    return module.removeprefix("plait.")


def _forbidden_pairs(contracts: list[dict[str, Any]]) -> set[tuple[str, str]]:
    """(importer, imported) pairs of plait packages that the contracts forbid."""
    pairs: set[tuple[str, str]] = set()
    for c in contracts:
        if c["type"] == "layers":
            assert all(":" not in layer for layer in c["layers"]), "layers are independent ('|')"
            layers = [[_short(m.strip()) for m in layer.split("|")] for layer in c["layers"]]
            for i, layer in enumerate(
                layers
            ):  # listed top first: a layer may not import its own or higher ones
                pairs |= {(a, b) for a in layer for above in layers[: i + 1] for b in above if b != a}
        elif c["type"] == "independence":
            mods = [_short(m) for m in c["modules"]]
            pairs |= {(a, b) for a in mods for b in mods if a != b}
        elif c["type"] == "forbidden":
            pairs |= {
                (_short(a), _short(b))
                for a in c["source_modules"]
                for b in c["forbidden_modules"]
                if a.startswith("plait.") and b.startswith("plait.")
            }
        else:
            raise AssertionError(f"contract type {c['type']!r} is not understood by this test")
    return pairs


def test_contracts_forbid_exactly_what_the_table_forbids() -> None:
    forbidden = _forbidden_pairs(_importlinter()["contracts"])
    expected = {(a, b) for a in MAY_IMPORT for b in MAY_IMPORT if a != b and b not in MAY_IMPORT[a]}
    assert forbidden - expected == set(), "the contracts forbid imports the table allows"
    assert expected - forbidden == set(), "the contracts allow imports the table forbids"


def _requirement_name(req: str) -> str:
    match = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", req)
    assert match is not None, req
    return match.group(0).lower().replace("_", "-")


def _distribution(module: str, own: str) -> str | None:
    """The distribution that provides ``module`` (None: the standard library or the package itself)."""
    parts = module.split(".")
    if parts[0] == "plait":
        if len(parts) < 2 or parts[1] == own:
            return None
        return "plait-" + parts[1].replace("_", "-")
    if parts[0] in sys.stdlib_module_names:
        return None
    return _DISTRIBUTION.get(parts[0], parts[0]).lower()


def _imports(src: Path, own: str) -> tuple[set[str], set[str]]:
    """Distributions the code imports: all of them, and those imported when a module loads."""
    every: set[str] = set()
    eager: set[str] = set()
    for path in src.rglob("*.py"):
        tree = ast.parse(path.read_text(), str(path))
        top = {id(node) for node in tree.body}
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
                func = node.func
                called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                if called in _IMPORTING_CALLS and isinstance(node.args[0].value, str):
                    names = [node.args[0].value]
            for name in names:
                dist = _distribution(name, own)
                if dist is not None:
                    every.add(dist)
                    if id(node) in top:
                        eager.add(dist)
    return every, eager


PACKAGES = sorted(p.name for p in (ROOT / "packages").iterdir() if (p / "pyproject.toml").exists())


@pytest.mark.parametrize("package", PACKAGES)
def test_each_wheel_declares_exactly_what_it_imports(package: str) -> None:
    """Declared = imported: hard dependencies and extras together are the imports; a module that
    loads with the package imports hard dependencies only; plait dependencies follow the table."""
    project = tomllib.loads((ROOT / "packages" / package / "pyproject.toml").read_text())["project"]
    own = package.replace("-", "_")
    hard = {_requirement_name(r) for r in project.get("dependencies", [])}
    extras = {
        _requirement_name(r) for reqs in project.get("optional-dependencies", {}).values() for r in reqs
    }
    every, eager = _imports(ROOT / "packages" / package / "src", own)
    assert every <= hard | extras, f"plait-{package} imports undeclared {sorted(every - hard - extras)}"
    assert hard | extras <= every, f"plait-{package} declares unused {sorted(hard | extras - every)}"
    assert eager <= hard, f"plait-{package} imports optional packages when it loads: {sorted(eager - hard)}"
    plait_deps = {d.removeprefix("plait-").replace("-", "_") for d in hard if d.startswith("plait-")}
    assert plait_deps <= MAY_IMPORT[own], f"plait-{package} depends on {sorted(plait_deps - MAY_IMPORT[own])}"


# Runs import-linter with only the temporary copy of `plait` importable (the workspace's editable
# installs are taken off sys.path), so the check sees exactly the copied tree.
_RUNNER = """
import sys
tmp = sys.argv[1]
sys.path[:] = [tmp] + [p for p in sys.path if "/packages/" not in p and p not in ("", ".")]
from importlinter.cli import lint_imports
sys.exit(lint_imports(config_filename=sys.argv[2], no_cache=True, no_logo=True))
"""


def _config_toml(config: dict[str, Any]) -> str:
    """The ``[tool.importlinter]`` table as TOML (JSON strings, lists and booleans are valid TOML)."""
    lines = ["[tool.importlinter]"]
    lines += [f"{k} = {json.dumps(v)}" for k, v in config.items() if k != "contracts"]
    for contract in config["contracts"]:
        lines += ["", "[[tool.importlinter.contracts]]"]
        lines += [f"{k} = {json.dumps(v)}" for k, v in contract.items()]
    return "\n".join(lines) + "\n"


def _lint(tmp: Path, bad_import: bool) -> subprocess.CompletedProcess[str]:
    """All of the root pyproject's contracts over a copy of plait.dist_core and empty stand-ins for
    the other plait packages."""
    work = tmp / ("bad" if bad_import else "good")
    shutil.copytree(
        ROOT / "packages" / "dist-core" / "src" / "plait",
        work / "plait",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    for name in MAY_IMPORT:
        if name != "dist_core":
            (work / "plait" / name).mkdir()
            (work / "plait" / name / "__init__.py").write_text("")
    if bad_import:
        grad_norm = work / "plait" / "dist_core" / "grad_norm.py"
        grad_norm.write_text(grad_norm.read_text() + "\nimport plait.kernels  # deliberate violation\n")
    config = work / "importlinter.toml"
    config.write_text(_config_toml(_importlinter()))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(
        [sys.executable, "-c", _RUNNER, str(work), str(config)],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.slow
def test_cross_package_import_breaks_the_contract(tmp_path: Path) -> None:
    layers = next(c["name"] for c in _importlinter()["contracts"] if c["type"] == "layers")
    good = _lint(tmp_path, bad_import=False)
    assert good.returncode == 0, good.stdout + good.stderr
    bad = _lint(tmp_path, bad_import=True)
    assert bad.returncode != 0
    out = bad.stdout + bad.stderr
    assert f"{layers} BROKEN" in out and "plait.kernels" in out, out
