"""The documentation site: it builds with ``mkdocs build --strict`` (a warning, a broken link or a
docstring griffe cannot parse fails), and every package has its API reference page."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]


def _nav_pages(nav: list) -> list[str]:
    out: list[str] = []
    for item in nav:
        values = item.values() if isinstance(item, dict) else [item]
        for value in values:
            out += _nav_pages(value) if isinstance(value, list) else [value]
    return out


def test_every_package_has_a_reference_page_in_the_nav() -> None:
    config = yaml.load((REPO / "mkdocs.yml").read_text(), Loader=yaml.BaseLoader)
    pages = _nav_pages(config["nav"])
    for src in sorted((REPO / "packages").glob("*/src/plait/*/__init__.py")):
        module = src.parent.name
        page = f"reference/{module}.md"
        assert page in pages, f"mkdocs.yml nav lacks {page}"
        assert f"::: plait.{module}\n" in (REPO / "docs" / page).read_text(), f"docs/{page}"


def test_site_builds_strict(tmp_path: Path) -> None:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "--quiet",
            "--site-dir",
            str(tmp_path / "site"),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, (
        f"mkdocs build --strict failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    )
    assert "WARNING" not in proc.stderr, proc.stderr[-5000:]
    for page in (
        "index.html",
        "concepts/index.html",
        "reference/loop/index.html",
        "benchmarks/training/index.html",
    ):
        assert (tmp_path / "site" / page).is_file(), page
    assert 'id="plait.loop.Trainer"' in (tmp_path / "site" / "reference/loop/index.html").read_text()
