"""Pipeline state: one store, two views (whole step / one microbatch), converted by a per-key sharding spec."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Chunk", "MicrobatchSpec", "MicrobatchView", "PipelineState", "Shared", "Stack"]


@dataclass(frozen=True)
class Chunk:
    """Global value is split along `dim` into the microbatches; reading it globally concatenates them."""

    dim: int = 0


@dataclass(frozen=True)
class Stack:
    """Each microbatch holds one slice; the global value stacks them along a new `dim` (e.g. per-mb losses)."""

    dim: int = 0


@dataclass(frozen=True)
class Shared:
    """One value shared by every microbatch (e.g. a global token count); written through the global view."""


MicrobatchSpec = Chunk | Stack | Shared


class PipelineState:
    """Per-step store with a global view and per-microbatch views.

    Example:
        >>> state = PipelineState(4, specs={"labels": Chunk(0), "loss": Stack()})
        >>> state.global_view["labels"] = torch.arange(8)      # sliced into 4 microbatches on write
        >>> state.microbatch(1)["labels"]
        tensor([2, 3])
        >>> for i in range(4): state.microbatch(i)["loss"] = torch.tensor(float(i))
        >>> state.global_view["loss"]                          # stacked on read
        tensor([0., 1., 2., 3.])

    Args:
        num_microbatches: microbatches per step.
        specs: sharding spec per key; keys not listed use `default_spec`.
        default_spec: spec for unlisted keys (``Chunk(0)``).
    """

    def __init__(
        self,
        num_microbatches: int,
        specs: Mapping[str, MicrobatchSpec] | None = None,
        default_spec: MicrobatchSpec = Chunk(0),
    ) -> None:
        if num_microbatches < 1:
            raise ValueError(f"PipelineState.num_microbatches must be >= 1, got {num_microbatches}")
        self.num_microbatches = num_microbatches
        self.specs: dict[str, MicrobatchSpec] = dict(specs or {})
        self.default_spec = default_spec
        self._shards: dict[str, list[Any]] = {}
        self._replicated: dict[str, Any] = {}
        self.global_view = _GlobalView(self)

    def spec(self, key: str) -> MicrobatchSpec:
        return self.specs.get(key, self.default_spec)

    def reset(self) -> None:
        """Drop every value (specs are kept); call once per step."""
        self._shards.clear()
        self._replicated.clear()

    def microbatch(self, index: int) -> MicrobatchView:
        """View of microbatch `index`: reads/writes that microbatch's slice of every key."""
        if not 0 <= index < self.num_microbatches:
            raise IndexError(f"microbatch {index} out of range [0, {self.num_microbatches})")
        return MicrobatchView(self, index)

    def keys(self) -> list[str]:
        return list(self._replicated) + list(self._shards)

    def __repr__(self) -> str:
        return f"PipelineState(num_microbatches={self.num_microbatches}, keys={self.keys()})"

    # --- conversions ---
    def _write_global(self, key: str, value: Any) -> None:
        spec = self.spec(key)
        if isinstance(spec, Shared):
            self._shards.pop(key, None)
            self._replicated[key] = value
            return
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"PipelineState key {key!r} has spec {spec} and needs a tensor, got {type(value).__name__}"
            )
        m = self.num_microbatches
        if isinstance(spec, Chunk):
            if value.dim() == 0 or value.shape[spec.dim] < m:
                raise ValueError(
                    f"PipelineState key {key!r}: cannot split shape {tuple(value.shape)} along dim {spec.dim} "
                    f"into {m} microbatches"
                )
            parts = list(torch.tensor_split(value, m, dim=spec.dim))
        else:
            if value.dim() <= spec.dim or value.shape[spec.dim] != m:
                raise ValueError(
                    f"PipelineState key {key!r} (Stack dim {spec.dim}) needs size {m} along that dim, "
                    f"got shape {tuple(value.shape)}"
                )
            parts = list(torch.unbind(value, dim=spec.dim))
        self._replicated.pop(key, None)
        self._shards[key] = parts

    def _read_global(self, key: str) -> Any:
        if key in self._replicated:
            return self._replicated[key]
        if key not in self._shards:
            raise KeyError(f"PipelineState has no key {key!r} (keys: {self.keys()})")
        parts = self._shards[key]
        missing = [i for i, p in enumerate(parts) if p is None]
        if missing:
            raise KeyError(f"PipelineState key {key!r} was not written for microbatches {missing}")
        spec = self.spec(key)
        if isinstance(spec, Chunk):
            return torch.cat(parts, dim=spec.dim)
        assert isinstance(spec, Stack)
        return torch.stack(parts, dim=spec.dim)

    def _write_mb(self, key: str, index: int, value: Any) -> None:
        if isinstance(self.spec(key), Shared):
            raise KeyError(
                f"PipelineState key {key!r} is Shared: write it through global_view, not a microbatch"
            )
        self._shards.setdefault(key, [None] * self.num_microbatches)[index] = value

    def _read_mb(self, key: str, index: int) -> Any:
        if key in self._replicated:
            return self._replicated[key]
        parts = self._shards.get(key)
        if parts is None or parts[index] is None:
            raise KeyError(f"PipelineState has no key {key!r} for microbatch {index}")
        return parts[index]


class _GlobalView(MutableMapping[str, Any]):
    def __init__(self, state: PipelineState) -> None:
        self._s = state

    def __getitem__(self, key: str) -> Any:
        return self._s._read_global(key)

    def __setitem__(self, key: str, value: Any) -> None:
        self._s._write_global(key, value)

    def __delitem__(self, key: str) -> None:
        self._s._shards.pop(key, None)
        self._s._replicated.pop(key, None)

    def __iter__(self) -> Iterator[str]:
        return iter(self._s.keys())

    def __len__(self) -> int:
        return len(self._s.keys())


class MicrobatchView(MutableMapping[str, Any]):
    """Dict-like access to one microbatch's slice of a :class:`PipelineState`."""

    def __init__(self, state: PipelineState, index: int) -> None:
        self._s = state
        self.index = index

    def __getitem__(self, key: str) -> Any:
        return self._s._read_mb(key, self.index)

    def __setitem__(self, key: str, value: Any) -> None:
        self._s._write_mb(key, self.index, value)

    def __delitem__(self, key: str) -> None:
        parts = self._s._shards.get(key)
        if parts is None or parts[self.index] is None:
            raise KeyError(key)
        parts[self.index] = None

    def __iter__(self) -> Iterator[str]:
        i = self.index
        return iter(
            [k for k in self._s._replicated] + [k for k, p in self._s._shards.items() if p[i] is not None]
        )

    def __len__(self) -> int:
        return sum(1 for _ in self)
