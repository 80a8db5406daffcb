"""Build the site, serve it on 127.0.0.1 and save screenshots of two pages with headless Chromium.

    uv run python docs/screenshots.py OUT_DIR [--chromium PATH]

A check for a person to look at (a page that builds can still render badly); not part of the tests.
Needs a Chromium binary (``apt-get install chromium`` on Debian). Writes ``OUT_DIR/<page>.png``.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PAGES = {"concepts": "concepts/", "reference-loop": "reference/loop/"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="folder for the PNG files")
    ap.add_argument("--chromium", default=shutil.which("chromium") or shutil.which("chromium-browser"))
    args = ap.parse_args()
    if not args.chromium:
        sys.exit("screenshots.py: no chromium on PATH (apt-get install chromium, or pass --chromium)")
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        site = Path(tmp) / "site"
        env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
        cmd = [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(site)]
        subprocess.run(cmd, cwd=REPO, env=env, check=True)
        handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(site))
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            for name, path in PAGES.items():
                png = args.out / f"{name}.png"
                url = f"http://127.0.0.1:{server.server_address[1]}/{path}"
                subprocess.run(
                    [args.chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                     f"--user-data-dir={Path(tmp) / 'profile'}", "--window-size=1280,1600",
                     f"--screenshot={png.resolve()}", url],
                    check=True, capture_output=True, timeout=120,
                )  # fmt: skip
                print(f"{url} -> {png}")
        finally:
            server.shutdown()


if __name__ == "__main__":
    main()
