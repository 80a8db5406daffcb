"""A griffe extension for the site: Sphinx roles in docstrings (``:class:`~plait.loop.Trainer```,
``:meth:`fit```) render as code (``Trainer``, ``fit``) instead of showing the role markup."""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?:class|meth|func|attr|mod|data|obj|exc):`(~?)([^`]+)`")


def _plain(match: re.Match[str]) -> str:
    target = match.group(2)
    return f"`{target.rsplit('.', 1)[-1] if match.group(1) else target}`"


class SphinxRoles(griffe.Extension):
    """Rewrites Sphinx cross-reference roles of every docstring into inline code."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _ROLE.sub(_plain, obj.docstring.value)
