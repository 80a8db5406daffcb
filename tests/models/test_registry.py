"""The family boundary: the generic code names no family; every registered model_type resolves."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from plait.models import family_for, supported_model_types
from plait.models.registry import _FAMILIES

ROOT = Path(__file__).resolve().parents[2] / "packages" / "models" / "src" / "plait" / "models"
FAMILY_NAME = re.compile(r"qwen|llama|gpt_?oss|gpt-oss|deepseek|mistral|mixtral", re.IGNORECASE)
# Hugging Face's names of RoPE variants (values of rope_parameters.rope_type), not families.
ROPE_TYPES = re.compile(r"rope_type='llama3'|^llama3$")


def _family_dirs() -> set[Path]:
    return {ROOT / pkg.rsplit(".", 1)[1] for pkg in _FAMILIES.values()}


def _code_names(tree: ast.AST) -> list[tuple[int, str]]:
    """Identifiers, imported module names and non-docstring string constants of a module."""
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            out.append((node.lineno, node.id))
        elif isinstance(node, ast.Attribute):
            out.append((node.lineno, node.attr))
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.append((node.lineno, node.module))
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.FunctionDef | ast.ClassDef):
            out.append((node.lineno, node.name))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            out.append((node.lineno, node.value))
    return out


def test_code_outside_family_folders_names_no_family():
    families = _family_dirs()
    offenders = []
    for path in sorted(ROOT.rglob("*.py")):
        if path == ROOT / "registry.py" or any(d in path.parents for d in families):
            continue
        for line, name in _code_names(ast.parse(path.read_text())):
            if FAMILY_NAME.search(name) and not ROPE_TYPES.search(name):
                offenders.append(f"{path.relative_to(ROOT)}:{line}: {name}")
    assert not offenders, "generic code names a family:\n" + "\n".join(offenders)


def test_the_check_can_fail():
    tree = ast.parse('from plait.models.llama import LlamaConfig\nx = "qwen3"\n')
    hits = [n for _, n in _code_names(tree) if FAMILY_NAME.search(n)]
    assert hits == ["plait.models.llama", "LlamaConfig", "qwen3"]


@pytest.mark.parametrize("model_type", supported_model_types())
def test_every_model_type_resolves_to_its_family(model_type):
    family = family_for(model_type)
    assert (ROOT / family.name).is_dir()
    assert _FAMILIES[model_type] == f"plait.models.{family.name}"
