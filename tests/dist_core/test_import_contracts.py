"""A deliberate cross-package import breaks the import contracts (import-linter, as CI runs it).

The real contract for dist-core is read from the root pyproject and checked against a copy of
plait.dist_core in a temporary directory, once as is (must pass) and once with
``import plait.kernels`` added (must fail, naming the contract).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONTRACT = "dist-core imports only torch and pydantic"

# Runs import-linter with only the temporary copy of `plait` importable (the workspace's editable
# installs are taken off sys.path), so the check sees exactly the copied tree.
_RUNNER = """
import sys
tmp = sys.argv[1]
sys.path[:] = [tmp] + [p for p in sys.path if "/packages/" not in p and p not in ("", ".")]
from importlinter.cli import lint_imports
sys.exit(lint_imports(config_filename=sys.argv[2], no_cache=True, no_logo=True))
"""


def _lint(tmp: Path, bad_import: bool) -> subprocess.CompletedProcess[str]:
    src = ROOT / "packages" / "dist-core" / "src" / "plait"
    work = tmp / ("bad" if bad_import else "good")
    shutil.copytree(src, work / "plait", ignore=shutil.ignore_patterns("__pycache__"))
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    contract = next(c for c in contracts if c["name"] == CONTRACT)
    for module in contract["forbidden_modules"]:  # empty stand-ins for the other plait packages
        if module.startswith("plait."):
            (work / "plait" / module.split(".")[1]).mkdir()
            (work / "plait" / module.split(".")[1] / "__init__.py").write_text("")
    if bad_import:
        grad_norm = work / "plait" / "dist_core" / "grad_norm.py"
        grad_norm.write_text(grad_norm.read_text() + "\nimport plait.kernels  # deliberate violation\n")
    forbidden = ", ".join(f'"{m}"' for m in contract["forbidden_modules"])
    config = work / "importlinter.toml"
    config.write_text(
        '[tool.importlinter]\nroot_packages = ["plait"]\ninclude_external_packages = true\n\n'
        f'[[tool.importlinter.contracts]]\nname = "{CONTRACT}"\ntype = "forbidden"\n'
        f'source_modules = ["plait.dist_core"]\nforbidden_modules = [{forbidden}]\n'
    )
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
    good = _lint(tmp_path, bad_import=False)
    assert good.returncode == 0, good.stdout + good.stderr
    bad = _lint(tmp_path, bad_import=True)
    assert bad.returncode != 0
    out = bad.stdout + bad.stderr
    assert CONTRACT in out and "BROKEN" in out and "plait.kernels" in out, out
