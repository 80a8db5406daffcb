"""Tag ``torch.compile``'s caches with this package's source.

The caches key a compiled graph by the graph Dynamo traced, in which a plait op is one node
(``torch.ops.plait.gmm``). What the op expands to below it is not in the key: the traced body of a
``triton_op`` (``gmm``, the permutation ops) and the backward ops its autograd formula calls. So a
cache filled by another version of plait-kernels (an upgrade, a checkout of another commit) can hand
back compiled layers built from that version's ops: stale code, or a graph calling an op that no
longer exists (``'_OpNamespace' 'plait' object has no attribute ...``). A digest of the package's
Python source, appended to ``torch.compiler.config.cache_key_tag``, keeps each version's entries apart;
a changed plait-kernels recompiles once.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

__all__ = ["source_tag", "tag_compile_caches"]

_ROOT = Path(__file__).resolve().parent


def source_tag(root: Path = _ROOT) -> str:
    """``plait-kernels-<digest>``: a digest of every ``.py`` file under ``root`` (its path and bytes)."""
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return f"plait-kernels-{digest.hexdigest()[:16]}"


def tag_compile_caches(tag: str) -> None:
    """Append ``tag`` to ``torch.compiler.config.cache_key_tag`` (comma-separated; a tag set by the user, e.g.
    through ``TORCH_COMPILE_CACHE_KEY_TAG``, is kept)."""
    config = torch.compiler.config
    tags = [t for t in config.cache_key_tag.split(",") if t]
    if tag not in tags:
        config.cache_key_tag = ",".join([*tags, tag])
