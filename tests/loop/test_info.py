"""The ``plait`` command (``plait.loop.info``): installed packages with versions, extras, devices."""

from __future__ import annotations

import importlib
import subprocess
import sys
import tomllib
from pathlib import Path

import torch
from plait.loop.info import EXTRAS, InstallInfo, collect, render

REPO = Path(__file__).resolve().parents[2]


def _workspace_versions() -> dict[str, str]:
    out = {}
    for path in [REPO / "pyproject.toml", *sorted(REPO.glob("packages/*/pyproject.toml"))]:
        project = tomllib.loads(path.read_text())["project"]
        out[project["name"]] = project["version"]
    return out


def _importable(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    except Exception:  # installed but failing on import (e.g. a CUDA-only build): still present
        return True
    return True


def test_collect_finds_the_workspace_the_extras_and_the_devices() -> None:
    info = collect()
    for name, version in _workspace_versions().items():
        assert info.packages.get(name) == version, name
    assert info.packages["torch"] == torch.__version__
    for extra in EXTRAS:
        assert (info.extras[extra.distribution] is not None) == _importable(extra.module), extra.distribution
    cuda = [d for d in info.devices if d.startswith("cuda:") and "none" not in d]
    assert len(cuda) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    assert info.devices[0].startswith("cpu:")


def test_render_names_missing_extras_and_where_to_start() -> None:
    extras = {e.distribution: None for e in EXTRAS} | {"triton": "3.0.0"}
    text = render(InstallInfo("3.11", {"plait-loop": "9.9"}, extras, ["cpu: 2 cores", "cuda: none visible"]))
    lines = text.splitlines()
    assert "  plait-loop           9.9" in lines
    assert any(line.split()[:2] == ["triton", "3.0.0"] for line in lines)
    assert any(
        line.split()[:2] == ["flash-attn", "missing"] and "plait-models[flash]" in line for line in lines
    )
    assert "  cuda: none visible" in lines
    assert any(line.split()[:2] == ["plait", "train"] for line in lines[lines.index("where to start:") :])


def test_plait_console_script_prints_the_report() -> None:
    script = Path(sys.executable).parent / "plait"
    proc = subprocess.run([str(script)], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name, version in _workspace_versions().items():
        assert f"  {name:<20} {version}" in proc.stdout.splitlines(), name
    assert "optional extras:" in proc.stdout and "where to start:" in proc.stdout
