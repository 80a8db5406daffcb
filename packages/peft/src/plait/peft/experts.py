"""LoRA for grouped-expert weights ``[E, out, in]`` (one rank-r adapter per expert).

The module that owns the expert weights (e.g. ``plait.moe``'s ``GroupedExperts`` with
``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``) implements :class:`ExpertAdapterHost`:
:func:`plait.peft.apply_peft` hands it one :class:`ExpertLoRA` per targeted weight through
``attach_adapter(param_name, adapter)``, and the module, right after each grouped GEMM, passes the
GEMM output through the adapter (``plait.moe.ExpertAdapter`` is what it calls, and
:class:`ExpertLoRA` provides it), which adds ``scaling * B_e A_e x`` with two more rank-r grouped
GEMMs on the same expert-contiguous rows (so it composes with any grouped-GEMM backend)::

    h = gmm(x, self.gate_up_proj, tokens_per_expert, trans_w=True)
    if "gate_up_proj" in self.adapters:
        h = self.adapters["gate_up_proj"](h, x, tokens_per_expert, gmm=gmm)

:func:`plait.peft.apply_peft` refuses expert targets on modules that do not implement the protocol
(their forward would ignore the adapters) unless ``require_expert_hook=False``; on such a module the
adapters hang in an ``nn.ModuleDict`` named ``lora`` (merge-only use, e.g. transformers' experts).

The base weights keep their names (no ``base_layer`` renaming), so base checkpoints load
unchanged. When merged, the adapter returns ``h`` untouched.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch
from plait.model_state import full_tensor, local_view
from plait.peft._dtensor import local_chunk, simple_placements
from plait.peft._init import init_adapter
from plait.peft.config import LoRAInit
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = [
    "ExpertAdapterHost",
    "ExpertLoRA",
    "GroupedMM",
    "attach_expert_adapter",
    "detach_expert_adapters",
    "expert_adapters_of",
    "grouped_mm",
]

# The ModuleDict that holds the adapters of a module that is not an ExpertAdapterHost (only with
# require_expert_hook=False); named like plait.moe's own, so that adapter files look the same.
_FOREIGN_ADAPTERS = "lora"


@runtime_checkable
class ExpertAdapterHost(Protocol):
    """A module owning grouped expert weights whose forward calls adapters on them.

    plait.moe's ``GroupedExperts`` implements it (structurally: neither package imports the other);
    so may a user's own expert module.
    """

    @property
    def adapters(self) -> nn.ModuleDict:
        """The attached adapters, by the name of the weight they adapt."""
        ...

    def attach_adapter(self, param_name: str, adapter: nn.Module) -> None:
        """Call ``adapter`` (an :class:`ExpertLoRA`) after the grouped GEMM of weight ``param_name``."""
        ...

    def detach_adapters(self) -> None:
        """Remove every attached adapter."""
        ...


def expert_adapters_of(module: nn.Module) -> nn.ModuleDict | None:
    """The expert adapters attached to ``module`` by weight name (None: it holds none and cannot)."""
    if isinstance(module, ExpertAdapterHost):
        return module.adapters
    held = dict(module.named_children()).get(_FOREIGN_ADAPTERS)
    return held if isinstance(held, nn.ModuleDict) else None


def attach_expert_adapter(host: nn.Module, param_name: str, adapter: ExpertLoRA) -> None:
    """Attach ``adapter`` to ``host``'s weight ``param_name``: through the host's ``attach_adapter``
    (:class:`ExpertAdapterHost`), else (merge-only) into a ``lora`` ``nn.ModuleDict`` added to ``host``.

    Raises:
        ValueError: the weight has an adapter already, or a foreign ``host`` has another ``lora``.
    """
    held = expert_adapters_of(host)
    if held is not None and param_name in held:
        raise ValueError(f"lora: parameter {param_name!r} of {type(host).__name__} is already adapted")
    if isinstance(host, ExpertAdapterHost):
        host.attach_adapter(param_name, adapter)
        return
    if held is None:
        if hasattr(host, _FOREIGN_ADAPTERS):
            raise ValueError(f"lora: {type(host).__name__} already has an attribute {_FOREIGN_ADAPTERS!r}")
        held = nn.ModuleDict()
        host.add_module(_FOREIGN_ADAPTERS, held)
    assert isinstance(held, nn.ModuleDict)
    held[param_name] = adapter


def detach_expert_adapters(host: nn.Module) -> None:
    """Remove every expert adapter of ``host`` (what :func:`attach_expert_adapter` attached)."""
    if isinstance(host, ExpertAdapterHost):
        host.detach_adapters()
    elif expert_adapters_of(host) is not None:
        delattr(host, _FOREIGN_ADAPTERS)


GroupedMM = Callable[..., torch.Tensor]
"""``gmm(x [M, K], w [E, N, K], tokens_per_expert [E], trans_w=True) -> [M, N]`` (plait.kernels.gmm's signature)."""


def grouped_mm(
    x: torch.Tensor, w: torch.Tensor, tokens_per_expert: torch.Tensor, trans_w: bool = False
) -> torch.Tensor:
    """Reference grouped GEMM: rows of ``x`` grouped contiguously by expert.

    Args:
        x: ``[M, K]`` with ``sum(tokens_per_expert) == M``.
        w: ``[E, K, N]`` or, with ``trans_w=True``, ``[E, N, K]`` (nn.Linear layout).
        tokens_per_expert: ``[E]`` integer counts.
        trans_w: whether ``w`` is in nn.Linear layout.
    """
    counts = [int(c) for c in tokens_per_expert.tolist()]
    if len(counts) != w.shape[0]:
        raise ValueError(f"grouped_mm: tokens_per_expert has {len(counts)} experts, weight has {w.shape[0]}")
    if sum(counts) != x.shape[0]:
        raise ValueError(f"grouped_mm: tokens_per_expert sums to {sum(counts)}, x has {x.shape[0]} rows")
    outs = [xe @ (w[e].T if trans_w else w[e]) for e, xe in enumerate(torch.split(x, counts))]
    n = w.shape[1] if trans_w else w.shape[2]
    return torch.cat(outs) if outs else x.new_zeros(0, n)


class ExpertLoRA(nn.Module):
    """Per-expert LoRA on one grouped weight ``W [E, out, in]``: ``dW_e = scaling * B_e @ A_e``.

    Parameters: ``lora_A [E, r, in]`` and ``lora_B [E, out, r]`` (nn.Linear layout per expert, so
    they feed the same ``gmm(..., trans_w=True)`` as the base weight). Shard them like the base
    weight on the expert dim (``Shard(0)``) under expert parallelism.

    The adapter does not hold a reference to the weight (that would break ``deepcopy`` and
    FSDP's parameter swaps); merge/unmerge take it as an argument. :func:`plait.peft.merge_peft`
    finds it as ``getattr(host, adapter.param_name)``.

    Args:
        weight: the grouped weight ``[E, out, in]`` (shapes, dtype, device; read by PiSSA init).
        param_name: attribute name of the weight on its module.
        r: the rank, as in :class:`plait.peft.LoRAConfig`.
        alpha: the scale numerator, as in :class:`plait.peft.LoRAConfig`.
        dropout: dropout on the adapter's input, as in :class:`plait.peft.LoRAConfig`.
        use_rslora: rank-stabilised scaling, as in :class:`plait.peft.LoRAConfig`.
        init: the initialisation, as in :class:`plait.peft.LoRAConfig`.
    """

    def __init__(
        self,
        weight: torch.Tensor,
        param_name: str,
        *,
        r: int,
        alpha: float,
        dropout: float = 0.0,
        use_rslora: bool = False,
        init: LoRAInit = "kaiming",
    ) -> None:
        super().__init__()
        w = weight
        if not isinstance(w, torch.Tensor) or w.ndim != 3:
            shape = tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__
            raise ValueError(f"ExpertLoRA: {param_name} must be a 3-D [E, out, in] weight, got {shape}")
        if r <= 0:
            raise ValueError(f"LoRA rank r must be positive, got {r}")
        e, out_f, in_f = w.shape
        self.lora_A = nn.Parameter(torch.empty(e, r, in_f, device=w.device, dtype=w.dtype))
        self.lora_B = nn.Parameter(torch.empty(e, out_f, r, device=w.device, dtype=w.dtype))
        self.lora_dropout: nn.Module = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.param_name = param_name
        self.num_experts, self.out_features, self.in_features = e, out_f, in_f
        self.r, self.alpha, self.use_rslora, self.init = r, alpha, use_rslora, init
        self.scaling = alpha / (math.sqrt(r) if use_rslora else r)
        self.merged = False
        self._original: torch.Tensor | None = None
        if w.device.type != "meta":
            self.reset_adapter_parameters(w)

    def extra_repr(self) -> str:
        return (
            f"{self.param_name}: experts={self.num_experts}, in={self.in_features}, out={self.out_features}, "
            f"r={self.r}, scaling={self.scaling:g}, merged={self.merged}"
        )

    @torch.no_grad()
    def reset_adapter_parameters(
        self, weight: torch.Tensor | None = None, generator: torch.Generator | None = None
    ) -> None:
        """(Re)initialise per ``init`` (per expert, like :class:`plait.peft.LoRALinear`; DTensor-aware).

        Args:
            weight: the base grouped weight; required by PiSSA, which also rewrites it.
            generator: random generator for the draws.
        """
        a, b = self.lora_A, self.lora_B
        if self.init == "pissa" and weight is None:
            raise ValueError(f"ExpertLoRA({self.param_name}): PiSSA init needs the base weight")
        init_adapter(
            a,
            b,
            weight,
            init=self.init,
            r=self.r,
            scaling=self.scaling,
            fan_in=self.in_features,
            generator=generator,
        )

    def forward(
        self,
        out: torch.Tensor,
        x: torch.Tensor,
        tokens_per_expert: torch.Tensor,
        gmm: GroupedMM | None = None,
    ) -> torch.Tensor:
        """Add the adapter to a grouped GEMM output.

        Args:
            out: ``[M, out]``, the base ``gmm(x, W, tokens_per_expert, trans_w=True)``.
            x: ``[M, in]`` expert-contiguous input rows of that GEMM.
            tokens_per_expert: ``[E_local]`` row counts per (local) expert.
            gmm: grouped GEMM to use (e.g. ``plait.kernels.gmm``); default :func:`grouped_mm`.

        Returns:
            ``out + scaling * B_e A_e dropout(x)`` per expert group (``out`` itself once merged).
        """
        if self.merged:
            return out
        mm = gmm if gmm is not None else grouped_mm
        # expert parallelism: the adapters are Shard(0) DTensors like the expert weights; use local experts
        a, b = local_view(self.lora_A), local_view(self.lora_B)
        if tokens_per_expert.numel() != a.shape[0]:
            raise ValueError(
                f"ExpertLoRA({self.param_name}): tokens_per_expert has {tokens_per_expert.numel()} experts, "
                f"the adapter holds {a.shape[0]} (shard it like the expert weight)"
            )
        h = mm(self.lora_dropout(x.to(a.dtype)), a, tokens_per_expert, trans_w=True)
        delta = mm(h, b, tokens_per_expert, trans_w=True) * self.scaling
        return out + delta.to(out.dtype)

    # ---- merge / unmerge -------------------------------------------------------------------
    def delta_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """``scaling * B_e @ A_e`` for all (local) experts, float32, shaped like the local base weight."""
        a = full_tensor(self.lora_A.detach()).float()
        b = full_tensor(self.lora_B.detach()).float()
        w = weight
        if isinstance(w, DTensor):
            if simple_placements(w.placements):
                a = local_chunk(a, w, {0: 0, 2: 2})
                b = local_chunk(b, w, {0: 0, 1: 1})
            else:
                return local_chunk(torch.bmm(b, a) * self.scaling, w)
        return torch.bmm(b, a) * self.scaling

    @torch.no_grad()
    def merge(self, weight: torch.Tensor, keep_original: bool = False) -> None:
        """Fold the adapters into ``weight`` (the host's grouped weight); see :meth:`plait.peft.LoRALinear.merge`."""
        if self.merged:
            raise RuntimeError(f"ExpertLoRA({self.param_name}).merge: already merged")
        w = local_view(weight)
        self._original = w.detach().clone() if keep_original else None
        w.copy_((w.float() + self.delta_weight(weight)).to(w.dtype))
        self.merged = True

    @torch.no_grad()
    def unmerge(self, weight: torch.Tensor) -> None:
        """Undo :meth:`merge` on the same ``weight``."""
        if not self.merged:
            raise RuntimeError(f"ExpertLoRA({self.param_name}).unmerge: not merged")
        w = local_view(weight)
        if self._original is not None:
            w.copy_(self._original)
            self._original = None
        else:
            w.copy_((w.float() - self.delta_weight(weight)).to(w.dtype))
        self.merged = False
