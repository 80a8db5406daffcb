"""mkdocs hooks: the package READMEs and the benchmark tables become pages of the site, and links that
leave the documentation folder point at those pages or, for other repository files, name the file.

The markdown stays written for reading on the repository (relative links between READMEs, the
migration guide's ``../examples/...``); this module maps those links onto the site at build time.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

REPO = Path(__file__).resolve().parent.parent
DOCS = "docs"

# Repository markdown files published as site pages: repository path -> page path in the site.
PAGES: dict[str, str] = {
    f"packages/{p.parent.name}/README.md": f"packages/{p.parent.name}.md"
    for p in sorted(REPO.glob("packages/*/README.md"))
}
PAGES.update(
    {
        f"benchmarks/results/{p.name}": f"benchmarks/{p.name}"
        for p in sorted(REPO.glob("benchmarks/results/*.md"))
    }
)
SOURCE_OF = {page: repo for repo, page in PAGES.items()}

_LINK = re.compile(r"(?<!!)\[([^\]]*)\]\(([^)\s]+)\)")


def on_files(files: Files, config: Any) -> Files:
    """Add the package READMEs and benchmark tables as generated pages."""
    for repo_path, page in PAGES.items():
        files.append(File.generated(config, page, content=(REPO / repo_path).read_text()))
    return files


def _repo_path_of(page_src: str) -> str:
    return SOURCE_OF.get(page_src, f"{DOCS}/{page_src}")


def _rewrite(markdown: str, page_src: str) -> str:
    here = posixpath.dirname(_repo_path_of(page_src))

    def sub(m: re.Match[str]) -> str:
        text, target = m.group(1), m.group(2)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith(("#", "/")):
            return m.group(0)  # a URL, an anchor of this page, or a site-absolute path
        path, _, anchor = target.partition("#")
        repo_target = posixpath.normpath(posixpath.join(here, path))
        if repo_target.startswith(f"{DOCS}/"):
            page = repo_target[len(DOCS) + 1 :]
        elif repo_target in PAGES:
            page = PAGES[repo_target]
        else:  # another repository file: name it (the site does not hold it)
            return f"{text} (`{repo_target}`)" if text.strip("`") != repo_target else f"`{repo_target}`"
        rel = posixpath.relpath(page, posixpath.dirname(page_src) or ".")
        return f"[{text}]({rel}{'#' + anchor if anchor else ''})"

    return _LINK.sub(sub, markdown)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    """Map links to repository files onto the site's pages."""
    return _rewrite(markdown, page.file.src_uri)
