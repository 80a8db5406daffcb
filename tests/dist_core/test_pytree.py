"""PyTree sharding: property-based round trips and torch.tensor_split semantics, plus errors."""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from plait.dist_core import TensorSplit, Whole, shard_tree, split_sizes, unshard_tree

Pair = namedtuple("Pair", ["left", "right"])


@st.composite
def tensor_and_dim(draw: st.DrawFn) -> tuple[torch.Tensor, int]:
    shape = draw(st.lists(st.integers(0, 5), min_size=1, max_size=3))
    dim = draw(st.integers(-len(shape), len(shape) - 1))
    numel = 1
    for s in shape:
        numel *= s
    t = torch.arange(numel, dtype=torch.float32).reshape(shape) + draw(st.integers(0, 100))
    return t, dim


scalars = st.one_of(st.integers(-5, 5), st.floats(allow_nan=False, width=32), st.text(max_size=3), st.none())


@st.composite
def tree_and_spec(draw: st.DrawFn, depth: int = 2) -> tuple[object, object]:
    kind = draw(
        st.sampled_from(["tensor", "scalar", "dict", "list", "tuple"] if depth > 0 else ["tensor", "scalar"])
    )
    if kind == "tensor":
        t, dim = draw(tensor_and_dim())
        return t, draw(st.sampled_from([TensorSplit(dim), Whole()]))
    if kind == "scalar":
        return draw(scalars), Whole()
    children = draw(st.lists(tree_and_spec(depth=depth - 1), max_size=3))
    if kind == "dict":
        tree = {f"k{i}": c[0] for i, c in enumerate(children)}
        spec = {f"k{i}": c[1] for i, c in enumerate(children)}
    else:
        tree = [c[0] for c in children]
        spec = [c[1] for c in children]
        if kind == "tuple":
            tree, spec = tuple(tree), tuple(spec)
    return tree, spec


def assert_tree_equal(a: object, b: object) -> None:
    assert type(a) is type(b)
    if isinstance(a, dict):
        assert a.keys() == b.keys()  # type: ignore[attr-defined]
        for k in a:
            assert_tree_equal(a[k], b[k])  # type: ignore[index]
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)  # type: ignore[arg-type]
        for x, y in zip(a, b):  # type: ignore[call-overload]
            assert_tree_equal(x, y)
    elif isinstance(a, torch.Tensor):
        assert a.shape == b.shape and torch.equal(a, b)  # type: ignore[union-attr,arg-type]
    else:
        assert a == b


@settings(max_examples=60, deadline=None)
@given(data=tree_and_spec(), n=st.integers(1, 5))
def test_shard_unshard_round_trip(data: tuple[object, object], n: int) -> None:
    tree, spec = data
    parts = [shard_tree(tree, spec, i, n) for i in range(n)]
    assert_tree_equal(unshard_tree(parts, spec), tree)


@settings(max_examples=60, deadline=None)
@given(td=tensor_and_dim(), n=st.integers(1, 6))
def test_split_matches_documented_sizes(td: tuple[torch.Tensor, int], n: int) -> None:
    t, dim = td
    size = t.shape[dim]
    sizes = split_sizes(size, n)
    assert sum(sizes) == size and max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)  # larger parts first
    start = 0
    for i, s in enumerate(sizes):
        part = shard_tree({"x": t}, TensorSplit(dim), i, n)["x"]
        assert part.shape[dim] == s
        torch.testing.assert_close(part, t.narrow(dim, start, s), rtol=0, atol=0)
        start += s


def test_prefix_spec_and_namedtuple() -> None:
    tree = {"a": Pair(torch.arange(6), torch.arange(4)), "b": {"c": 3, "d": torch.ones(2, 5)}}
    spec = {"a": TensorSplit(0), "b": {"c": Whole(), "d": TensorSplit(1)}}
    part = shard_tree(tree, spec, 1, 2)
    assert isinstance(part["a"], Pair)
    assert part["a"].left.tolist() == [3, 4, 5] and part["a"].right.tolist() == [2, 3]
    assert part["b"]["c"] == 3 and part["b"]["d"].shape == (2, 2)
    assert_tree_equal(unshard_tree([shard_tree(tree, spec, i, 2) for i in range(2)], spec), tree)


def test_uneven_and_empty_parts() -> None:
    assert split_sizes(5, 3) == [2, 2, 1]
    assert split_sizes(2, 4) == [1, 1, 0, 0]
    assert shard_tree(torch.arange(2), TensorSplit(), 3, 4).numel() == 0


def test_errors_name_the_path() -> None:
    with pytest.raises(ValueError, match=r"cannot TensorSplit the int leaf at \['b'\]"):
        shard_tree({"a": torch.ones(2), "b": 1}, TensorSplit(0), 0, 2)
    with pytest.raises(ValueError, match=r"\['a'\]"):
        shard_tree({"a": torch.ones(2)}, {"b": TensorSplit(0)}, 0, 2)
    with pytest.raises(ValueError, match=r"TensorSplit\(dim=2\) at \[0\] is out of range"):
        shard_tree([torch.ones(2, 2)], TensorSplit(2), 0, 2)
    with pytest.raises(ValueError, match="index < n"):
        shard_tree(torch.ones(2), TensorSplit(0), 2, 2)
    with pytest.raises(ValueError, match=r"replicated leaf at \['s'\] differs"):
        unshard_tree([{"s": 1}, {"s": 2}], Whole())
    with pytest.raises(ValueError, match="structure"):
        unshard_tree([[torch.ones(1)], [torch.ones(1), torch.ones(1)]], TensorSplit(0))
