"""Stateful adapters that put a training run's pieces into one DCP state dict.

DCP saves ``Stateful`` objects by calling ``state_dict()`` and restores them with
``load_state_dict()``. Model and optimizer go through ``torch.distributed.checkpoint.state_dict``
so FSDP2/DTensor parameters are saved as global tensors and reshard on load to any layout.
"""

from __future__ import annotations

import random
from typing import Any

import torch
import torch.distributed as dist
from plait.loop.checkpoint import _codec
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)


class ModelState:
    """The model parts a rank holds (one per pipeline stage), as one flat state dict by FQN."""

    def __init__(self, parts: nn.Module | list[nn.Module]) -> None:
        self.parts = parts if isinstance(parts, list) else [parts]

    def state_dict(self) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        for part in self.parts:
            sd = get_model_state_dict(part)
            clash = merged.keys() & sd.keys()
            if clash:
                raise ValueError(
                    f"model parts share parameter names {sorted(clash)[:5]}; give stages unique FQNs"
                )
            merged.update(sd)
        return merged

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for part in self.parts:
            set_model_state_dict(part, state_dict, options=StateDictOptions(strict=False))


class OptimizerState:
    """Optimizers paired with the model parts they update, flattened so several parts merge."""

    _OPTS = StateDictOptions(flatten_optimizer_state_dict=True)

    def __init__(self, parts: nn.Module | list[nn.Module], optimizers: Any) -> None:
        self.parts = parts if isinstance(parts, list) else [parts]
        self.optimizers = optimizers if isinstance(optimizers, list) else [optimizers]
        if len(self.parts) != len(self.optimizers):
            raise ValueError(f"{len(self.parts)} model parts but {len(self.optimizers)} optimizers")

    def state_dict(self) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        for part, opt in zip(self.parts, self.optimizers):
            merged.update(get_optimizer_state_dict(part, opt, options=self._OPTS))
        return merged

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for part, opt in zip(self.parts, self.optimizers):
            set_optimizer_state_dict(part, opt, optim_state_dict=state_dict, options=self._OPTS)


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class PerRankState:
    """Wraps a Stateful whose state differs per rank (RNGs, local metric accumulators).

    Each rank writes its own key ``rank<N>`` (DCP would otherwise keep one copy of identically named
    objects), as one blob so that a structure that grows during training (metrics created on first
    use) still loads into a fresh object. The blob is JSON with tagged tensors and tuples
    (:mod:`plait.loop.checkpoint._codec`), not a pickle: loading it cannot run code. On a world size the checkpoint did not have, the
    :class:`~plait.loop.checkpoint.Checkpointer` skips ranks without a saved state, with a warning.
    """

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def state_dict(self) -> dict[str, Any]:
        return {f"rank{_rank()}": _codec.encode(self.inner.state_dict())}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.inner.load_state_dict(_codec.decode(state_dict[f"rank{_rank()}"]))


class _Generators:
    """Every RNG a rank uses: Python, torch CPU, CUDA, NumPy if present."""

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state_all()
        try:
            import numpy as np

            state["numpy"] = np.random.get_state()
        except ImportError:
            pass
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        random.setstate(state["python"])
        torch.set_rng_state(state["torch"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])
        if "numpy" in state:
            import numpy as np

            np.random.set_state(state["numpy"])


class RngState(PerRankState):
    """Every RNG of this rank (Python, torch CPU, CUDA, NumPy), saved per rank."""

    def __init__(self) -> None:
        super().__init__(_Generators())


class ValueState:
    """A plain value (step counter, tracker run id) as a Stateful, identical on every rank."""

    def __init__(self, value: Any = None) -> None:
        self.value = value

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.value = state_dict["value"]
