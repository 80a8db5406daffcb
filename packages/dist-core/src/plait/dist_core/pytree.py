"""Shard and unshard nested containers (dicts, lists, tuples) of tensors and Python scalars.

A spec says what happens to each leaf: :class:`TensorSplit` along a dimension into ``n`` parts, or
:class:`Whole` (every part gets the leaf). The spec is either one spec for every leaf or a
*prefix tree* of the data: a container of the same kind whose entries are specs or sub-trees
(a spec at a node applies to every leaf below it).

Uneven splits follow ``torch.tensor_split``: a dimension of size ``s`` split into ``n`` parts
gives the first ``s % n`` parts ``s // n + 1`` elements and the others ``s // n`` (parts may be
empty when ``s < n``). :func:`split_sizes` returns these sizes. Shards are views of the input.
Python scalars (int, float, bool, str, None) can only be replicated.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

_SCALARS = (int, float, bool, str, type(None), complex)


@dataclass(frozen=True)
class TensorSplit:
    """Split a tensor leaf along ``dim`` (``torch.tensor_split`` sizes)."""

    dim: int = 0


@dataclass(frozen=True)
class Whole:
    """Give every shard the whole leaf. ``unshard_tree`` checks the replicas are equal."""


ShardSpec = TensorSplit | Whole


def split_sizes(size: int, n: int) -> list[int]:
    """Sizes of the ``n`` parts of a dimension of ``size`` (first ``size % n`` parts one larger)."""
    if n < 1:
        raise ValueError(f"number of parts must be >= 1, got {n}")
    return [size // n + (1 if i < size % n else 0) for i in range(n)]


def _path_str(path: tuple[Any, ...]) -> str:
    return "".join(f"[{p!r}]" for p in path) or "<root>"


def _spec_at(spec: Any, key: Any, path: tuple[Any, ...]) -> Any:
    if isinstance(spec, TensorSplit | Whole):
        return spec
    try:
        return spec[key]
    except (KeyError, IndexError, TypeError):
        raise ValueError(f"shard spec has no entry for {_path_str((*path, key))}") from None


def _check_container(tree: Any, spec: Any, path: tuple[Any, ...]) -> None:
    if isinstance(spec, TensorSplit | Whole):
        return
    if isinstance(tree, dict) and (not isinstance(spec, dict) or set(spec) != set(tree)):
        raise ValueError(f"shard spec at {_path_str(path)} must be a spec or a dict with keys {sorted(tree)}")
    if isinstance(tree, list | tuple) and (not isinstance(spec, list | tuple) or len(spec) != len(tree)):
        raise ValueError(
            f"shard spec at {_path_str(path)} must be a spec or a sequence of length {len(tree)}"
        )


def _rebuild(tree: Any, values: list[Any]) -> Any:
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):  # namedtuple
        return type(tree)(*values)
    return type(tree)(values)


def _shard(tree: Any, spec: Any, index: int, n: int, path: tuple[Any, ...]) -> Any:
    _check_container(tree, spec, path)
    if isinstance(tree, dict):
        return {k: _shard(v, _spec_at(spec, k, path), index, n, (*path, k)) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return _rebuild(
            tree, [_shard(v, _spec_at(spec, i, path), index, n, (*path, i)) for i, v in enumerate(tree)]
        )
    if not isinstance(spec, TensorSplit | Whole):
        raise ValueError(
            f"shard spec at {_path_str(path)} must be TensorSplit or Whole for a leaf, got {spec!r}"
        )
    if isinstance(spec, Whole):
        return tree
    if not isinstance(tree, torch.Tensor):
        raise ValueError(
            f"cannot TensorSplit the {type(tree).__name__} leaf at {_path_str(path)}; only tensors split"
        )
    if not -tree.ndim <= spec.dim < tree.ndim:
        raise ValueError(
            f"TensorSplit(dim={spec.dim}) at {_path_str(path)} is out of range for shape {tuple(tree.shape)}"
        )
    return torch.tensor_split(tree, n, dim=spec.dim)[index]


def shard_tree(tree: Any, spec: Any, index: int, n: int) -> Any:
    """Part ``index`` of ``n`` of ``tree``.

    Args:
        tree: nested dict/list/tuple of tensors and Python scalars.
        spec: a :class:`TensorSplit`/:class:`Whole` for every leaf, or a prefix tree of specs.
        index: which part, ``0 <= index < n``.
        n: number of parts.

    Raises:
        ValueError: bad index/n, a spec that does not match the tree (the path is named), a
            TensorSplit of a non-tensor leaf or of an out-of-range dimension.
    """
    if n < 1 or not 0 <= index < n:
        raise ValueError(f"need 0 <= index < n, got index={index}, n={n}")
    return _shard(tree, spec, index, n, ())


def _unshard(parts: Sequence[Any], spec: Any, path: tuple[Any, ...]) -> Any:
    first = parts[0]
    for p in parts[1:]:
        if type(p) is not type(first) or (isinstance(first, dict | list | tuple) and len(p) != len(first)):
            raise ValueError(f"shards differ in structure at {_path_str(path)}")
    _check_container(first, spec, path)
    if isinstance(first, dict):
        if any(set(p) != set(first) for p in parts):
            raise ValueError(f"shards have different keys at {_path_str(path)}")
        return {k: _unshard([p[k] for p in parts], _spec_at(spec, k, path), (*path, k)) for k in first}
    if isinstance(first, list | tuple):
        values = [
            _unshard([p[i] for p in parts], _spec_at(spec, i, path), (*path, i)) for i in range(len(first))
        ]
        return _rebuild(first, values)
    if not isinstance(spec, TensorSplit | Whole):
        raise ValueError(
            f"shard spec at {_path_str(path)} must be TensorSplit or Whole for a leaf, got {spec!r}"
        )
    if isinstance(spec, TensorSplit):
        if not isinstance(first, torch.Tensor):
            raise ValueError(f"cannot un-split the {type(first).__name__} leaf at {_path_str(path)}")
        return torch.cat(list(parts), dim=spec.dim)
    for p in parts[1:]:
        same = torch.equal(p, first) if isinstance(first, torch.Tensor) else p == first
        if not same:
            raise ValueError(f"replicated leaf at {_path_str(path)} differs between shards")
    return first


def unshard_tree(parts: Sequence[Any], spec: Any) -> Any:
    """Inverse of :func:`shard_tree`: concatenate TensorSplit leaves, check and keep Whole leaves.

    Args:
        parts: the shards, in index order (``[shard_tree(tree, spec, i, n) for i in range(n)]``).
        spec: the spec used to shard.

    Raises:
        ValueError: no parts, shards with different structure, or replicated leaves that differ
            (the path is named).
    """
    if len(parts) == 0:
        raise ValueError("unshard_tree needs at least one shard")
    return _unshard(parts, spec, ())
