"""LoRA and DoRA wrappers for ``nn.Linear``.

The wrapper keeps Hugging Face PEFT's module layout, so parameter names line up with HF adapter
files one to one::

    q_proj.base_layer.weight   (the original nn.Linear, frozen)
    q_proj.lora_A.weight       [r, in]
    q_proj.lora_B.weight       [out, r]
    q_proj.lora_magnitude_vector   [out]   (DoRA only)
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from plait.model_state import full_tensor, local_view
from plait.peft._dtensor import assign_full, local_chunk, simple_placements
from plait.peft._init import init_adapter
from plait.peft.config import LoRAInit
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["DoRALinear", "LoRALinear"]


class LoRALinear(nn.Module):
    """``base_layer(x) + scaling * lora_B(lora_A(dropout(x)))`` around a frozen ``nn.Linear``.

    Args:
        base_layer: the linear layer to adapt (kept as a submodule, parameters untouched).
        r: rank.
        alpha: scaling numerator.
        dropout: dropout probability on the adapter input.
        use_rslora: scaling = alpha / sqrt(r) instead of alpha / r.
        init: see :data:`plait.peft.config.LoRAInit`. On a meta-device base layer nothing is
            initialised; call :meth:`reset_adapter_parameters` after materialising.
    """

    def __init__(
        self,
        base_layer: nn.Linear,
        *,
        r: int,
        alpha: float,
        dropout: float = 0.0,
        use_rslora: bool = False,
        init: LoRAInit = "kaiming",
    ) -> None:
        super().__init__()
        if not isinstance(base_layer, nn.Linear):
            raise TypeError(f"LoRALinear wraps nn.Linear, got {type(base_layer).__name__}")
        if r <= 0:
            raise ValueError(f"LoRA rank r must be positive, got {r}")
        self.base_layer = base_layer
        w = base_layer.weight
        factory = {"device": w.device, "dtype": w.dtype}
        self.lora_A = nn.Linear(base_layer.in_features, r, bias=False, **factory)
        self.lora_B = nn.Linear(r, base_layer.out_features, bias=False, **factory)
        self.lora_dropout: nn.Module = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.r = r
        self.alpha = alpha
        self.use_rslora = use_rslora
        self.init: LoRAInit = init
        self.scaling = alpha / (math.sqrt(r) if use_rslora else r)
        self.merged = False
        self._original: torch.Tensor | None = None  # exact copy kept by merge(keep_original=True)
        self._create_extra_parameters()
        if w.device.type != "meta":
            self.reset_adapter_parameters()

    # nn.Linear look-alike attributes, so code that reads them keeps working after injection.
    @property
    def in_features(self) -> int:
        return self.base_layer.in_features

    @property
    def out_features(self) -> int:
        return self.base_layer.out_features

    @property
    def weight(self) -> torch.Tensor:
        """The (frozen) base weight; the adapter is *not* folded in unless merged."""
        return self.base_layer.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.base_layer.bias

    def extra_repr(self) -> str:
        return f"r={self.r}, alpha={self.alpha}, scaling={self.scaling:g}, init={self.init}, merged={self.merged}"

    def _create_extra_parameters(self) -> None:
        """Hook for subclasses that add parameters before initialisation (DoRA's magnitude)."""

    @torch.no_grad()
    def reset_adapter_parameters(self, generator: torch.Generator | None = None) -> None:
        """(Re)initialise A and B per ``init`` (PiSSA also rewrites the base weight).

        Works on DTensor (sharded) parameters: whole tensors are drawn/computed on every rank and
        each keeps its shard, so the result equals a single-process init with the same seed
        (PiSSA all-gathers the base weight of this one layer).
        """
        a, b = self.lora_A.weight, self.lora_B.weight
        init_adapter(
            a,
            b,
            self.base_layer.weight,
            init=self.init,
            r=self.r,
            scaling=self.scaling,
            fan_in=self.in_features,
            generator=generator,
        )

    def _adapter(self, x: torch.Tensor) -> torch.Tensor:
        return self.lora_B(self.lora_A(self.lora_dropout(x.to(self.lora_A.weight.dtype)))) * self.scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base_layer(x)
        if self.merged:
            return out
        return out + self._adapter(x).to(out.dtype)

    # ---- merge / unmerge -------------------------------------------------------------------
    def delta_weight(self) -> torch.Tensor:
        """``scaling * B @ A`` in float32, shaped like this rank's local shard of the base weight.

        On DTensor parameters this is a collective (the small factors are all-gathered).
        """
        a = full_tensor(self.lora_A.weight.detach()).float()
        b = full_tensor(self.lora_B.weight.detach()).float()
        w = self.base_layer.weight
        if isinstance(w, DTensor):
            if simple_placements(w.placements):
                # rows of W live with rows of B, columns of W with columns of A
                a = local_chunk(a, w, {1: 1})
                b = local_chunk(b, w, {0: 0})
            else:
                return local_chunk((b @ a) * self.scaling, w)
        return (b @ a) * self.scaling

    @torch.no_grad()
    def merge(self, keep_original: bool = False) -> None:
        """Fold the adapter into the base weight (computed in float32, stored in the weight dtype).

        Args:
            keep_original: keep a copy of the (local) base weight so :meth:`unmerge` restores it
                bit for bit; otherwise unmerge subtracts the same float32 delta (exact up to one
                rounding of the weight dtype).
        """
        if self.merged:
            raise RuntimeError("LoRALinear.merge: adapter is already merged")
        w = local_view(self.base_layer.weight)
        self._original = w.detach().clone() if keep_original else None
        w.copy_((w.float() + self.delta_weight()).to(w.dtype))
        self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        """Undo :meth:`merge`."""
        if not self.merged:
            raise RuntimeError("LoRALinear.unmerge: adapter is not merged")
        w = local_view(self.base_layer.weight)
        if self._original is not None:
            w.copy_(self._original)
            self._original = None
        else:
            w.copy_((w.float() - self.delta_weight()).to(w.dtype))
        self.merged = False


class DoRALinear(LoRALinear):
    """DoRA: ``m * (W + s B A) / ||W + s B A||_row`` with a trainable magnitude ``m`` [out].

    Numerics follow HF PEFT's ``DoraLinearLayer``: the row norm is detached, and the base output
    is reused unless dropout is active in training.
    """

    def __init__(
        self,
        base_layer: nn.Linear,
        *,
        r: int,
        alpha: float,
        dropout: float = 0.0,
        use_rslora: bool = False,
        init: LoRAInit = "kaiming",
    ) -> None:
        if init == "pissa":
            raise ValueError("DoRALinear: init='pissa' is not supported")
        super().__init__(base_layer, r=r, alpha=alpha, dropout=dropout, use_rslora=use_rslora, init=init)
        self._merge_norm: torch.Tensor | None = None  # row norms of W + dW at merge time

    def _create_extra_parameters(self) -> None:
        w = self.base_layer.weight
        self.lora_magnitude_vector = nn.Parameter(
            torch.empty(self.out_features, device=w.device, dtype=w.dtype)
        )

    @torch.no_grad()
    def reset_adapter_parameters(self, generator: torch.Generator | None = None) -> None:
        """(Re)initialise A, B and the magnitude ``||W + s B A||_row`` (DTensor-aware, see LoRALinear)."""
        super().reset_adapter_parameters(generator)
        w = full_tensor(self.base_layer.weight.detach()).float()
        ba = (
            full_tensor(self.lora_B.weight.detach()).float()
            @ full_tensor(self.lora_A.weight.detach()).float()
        )
        assign_full(self.lora_magnitude_vector, torch.linalg.vector_norm(w + self.scaling * ba, dim=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base_layer(x)
        if self.merged:
            return out
        a, b = self.lora_A.weight, self.lora_B.weight
        w = self.base_layer.weight.to(a.dtype)
        with torch.no_grad():
            norm = torch.linalg.vector_norm(w + self.scaling * (b @ a), dim=1)
        scale = (self.lora_magnitude_vector / norm).view(1, -1)
        xd = self.lora_dropout(x.to(a.dtype))
        lora_out = self.lora_B(self.lora_A(xd))
        if isinstance(self.lora_dropout, nn.Identity) or not self.training:
            base_out = out.to(a.dtype)
            if self.base_layer.bias is not None:
                base_out = base_out - self.base_layer.bias.to(a.dtype)
        else:
            base_out = F.linear(xd, w)
        extra = (scale - 1) * base_out + scale * lora_out * self.scaling
        return out + extra.to(out.dtype)

    def _merge_parts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(local float32 delta, local float32 magnitude) for this rank's rows of W."""
        w = self.base_layer.weight
        m = full_tensor(self.lora_magnitude_vector.detach()).float()
        if isinstance(w, DTensor):
            if not all(getattr(p, "dim", 0) == 0 for p in w.placements):
                raise NotImplementedError(
                    "DoRA merge on DTensors supports row sharding (Shard(0)/Replicate) only, got "
                    f"{w.placements}"
                )
            m = local_chunk(m, w, {0: 0})
        return self.delta_weight(), m

    @torch.no_grad()
    def merge(self, keep_original: bool = False) -> None:
        """Replace W by ``m * (W + s B A) / ||W + s B A||_row`` (float32 math); see :meth:`LoRALinear.merge`."""
        if self.merged:
            raise RuntimeError("DoRALinear.merge: adapter is already merged")
        w = local_view(self.base_layer.weight)
        delta, m = self._merge_parts()
        self._original = w.detach().clone() if keep_original else None
        v = w.float() + delta
        norm = torch.linalg.vector_norm(v, dim=1)
        self._merge_norm = norm  # needed by unmerge: the merged W has row norms m, not ||W + dW||
        w.copy_((v * (m / norm).unsqueeze(1)).to(w.dtype))
        self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        """Undo :meth:`merge`."""
        if not self.merged:
            raise RuntimeError("DoRALinear.unmerge: adapter is not merged")
        w = local_view(self.base_layer.weight)
        if self._original is not None:
            w.copy_(self._original)
        else:
            delta, m = self._merge_parts()
            assert self._merge_norm is not None
            w.copy_((w.float() * (self._merge_norm / m).unsqueeze(1) - delta).to(w.dtype))
        self._original = None
        self._merge_norm = None
        self.merged = False
