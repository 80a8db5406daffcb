"""Grouped gated experts (SwiGLU or gpt-oss's clamped SwiGLU, optional biases) and the shared expert."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import ClassVar, Protocol

import torch
from plait.kernels import gmm, swiglu, swiglu_fused
from plait.moe.config import ClampedSwiGLU, SwiGLU
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

GroupedMM = Callable[..., Tensor]
"""``gmm(x [M, K], w [E, N, K], tokens_per_expert [E], trans_w=True) -> [M, N]`` (plait.kernels.gmm's signature)."""


class ExpertAdapter(Protocol):
    """What an adapter on one grouped expert weight provides (plait.peft's ``ExpertLoRA`` is one).

    :meth:`GroupedExperts.attach_adapter` registers it as a submodule of the experts (so it must be an
    ``nn.Module``: its parameters train, shard and save with them), and the experts' forward calls it
    right after the grouped GEMM of that weight, on the same expert-contiguous rows.
    """

    def forward(self, out: Tensor, x: Tensor, tokens_per_expert: Tensor, gmm: GroupedMM) -> Tensor:
        """``out`` (the GEMM's ``[M, N]`` output) plus the adapter's term on the GEMM's input ``x``
        (``[M, K]``), computed with ``gmm`` over the ``[E_local]`` groups of ``tokens_per_expert``."""
        ...


def local_tensor(t: Tensor) -> Tensor:
    """The local shard of a DTensor parameter (differentiable), or the tensor itself."""
    # isinstance, not getattr(t, "to_local", None): torch.compile traces the former (the latter gave
    # the global shape under Dynamo).
    return t.to_local() if isinstance(t, DTensor) else t


def clamped_swiglu(gate_up: Tensor, alpha: float, limit: float, row_weight: Tensor | None = None) -> Tensor:
    """gpt-oss's activation on a fused ``[..., 2I]`` tensor (gate half first), fp32 math.

    ``g = clamp(gate, max=limit)``, ``u = clamp(up, -limit, limit)``, ``(u + 1) * g * sigmoid(alpha * g)``
    (times ``row_weight[..., None]`` if given), cast back to ``gate_up.dtype``. Plain PyTorch:
    ``torch.compile`` fuses it.
    """
    gate, up = gate_up.float().chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    y = (up + 1.0) * gate * torch.sigmoid(alpha * gate)
    if row_weight is not None:
        y = y * row_weight.float().unsqueeze(-1)
    return y.to(gate_up.dtype)


def row_experts(tokens_per_expert: Tensor, num_rows: int) -> Tensor:
    """``[num_rows]`` int64: the (local) expert of each expert-contiguous row; ``E`` for rows past the groups.

    No host synchronisation (a ``bucketize`` of the row ids into the groups' ends).
    """
    ends = torch.cumsum(tokens_per_expert, 0)
    rows = torch.arange(num_rows, device=tokens_per_expert.device, dtype=ends.dtype)
    return torch.bucketize(rows, ends, right=True)


def _bias_rows(bias: Tensor, experts_of_rows: Tensor) -> Tensor:
    """``bias[e]`` in fp32 for each row's expert ``e``; zero for the rows past the groups (expert id ``E``).

    fp32 so that the backward's scatter-add (one add per row into its expert's bias gradient) accumulates
    in fp32: in bf16 each of the thousands of adds rounds to 8 bits, in an order that changes run to run.
    """
    return torch.nn.functional.pad(bias.float(), (0, 0, 0, 1))[experts_of_rows]


class GroupedExperts(nn.Module):
    """E gated FFNs stored as stacked weights, computed with one grouped GEMM per projection.

    Parameters (Hugging Face Qwen3-MoE layout): ``gate_up_proj`` ``[E, 2I, H]`` (gate rows first) and
    ``down_proj`` ``[E, H, I]``; with ``bias=True`` also ``gate_up_proj_bias`` ``[E, 2I]`` (gate
    half first) and ``down_proj_bias`` ``[E, H]`` (else both None). Under expert parallelism all are
    DTensors ``Shard(0)`` and this module computes its local experts only. gpt-oss checkpoints keep
    the gate/up halves interleaved and the weights input-major: convert them with
    :mod:`plait.moe.layout`.

    Args:
        num_experts: E.
        hidden_size: H.
        intermediate_size: I.
        activation: :class:`SwiGLU` (default) or :class:`ClampedSwiGLU`.
        bias: Give both projections a per-expert bias.
    """

    # The weights an adapter may be attached to (attach_adapter), each called after its grouped GEMM.
    adaptable_weights: ClassVar[tuple[str, ...]] = ("gate_up_proj", "down_proj")
    # The grouped GEMM of both projections, ``grouped_mm(x, w, tokens_per_expert, trans_w=True)``:
    # plait's ``gmm``; float8 training may set another on an instance (plait.models' float8 experts).
    grouped_mm: GroupedMM = staticmethod(gmm)

    gate_up_proj_bias: nn.Parameter | None
    down_proj_bias: nn.Parameter | None
    # The attached adapters by weight name (see attach_adapter). Registered as ``lora``: the state-dict
    # keys of adapter files and checkpoints (``...experts.lora.gate_up_proj.lora_A``) stay as they were.
    lora: nn.ModuleDict

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        activation: SwiGLU | ClampedSwiGLU | None = None,
        bias: bool = False,
    ) -> None:
        super().__init__()
        if activation is not None and not isinstance(activation, SwiGLU | ClampedSwiGLU):
            raise TypeError(
                f"GroupedExperts.activation must be SwiGLU or ClampedSwiGLU, got {type(activation).__name__}"
            )
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.activation: SwiGLU | ClampedSwiGLU = activation if activation is not None else SwiGLU()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        if bias:
            self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size))
            self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden_size))
        else:
            self.gate_up_proj_bias = None
            self.down_proj_bias = None
        self.lora = nn.ModuleDict()
        self.reset_parameters()

    @property
    def adapters(self) -> nn.ModuleDict:
        """The attached adapters (:class:`ExpertAdapter`), by the name of the weight they adapt."""
        return self.lora

    def attach_adapter(self, param_name: str, adapter: ExpertAdapter) -> None:
        """Call ``adapter`` after the grouped GEMM of the weight ``param_name`` from now on.

        Args:
            param_name: ``"gate_up_proj"`` or ``"down_proj"`` (:attr:`adaptable_weights`).
            adapter: an ``nn.Module`` implementing :class:`ExpertAdapter`; it becomes a submodule.

        Raises:
            ValueError: another weight name, or a weight that has an adapter already.
            TypeError: an adapter that is not an ``nn.Module``.
        """
        if param_name not in self.adaptable_weights:
            raise ValueError(
                f"GroupedExperts.attach_adapter: {param_name!r} is not one of {list(self.adaptable_weights)}"
            )
        if not isinstance(adapter, nn.Module):
            raise TypeError(f"GroupedExperts.attach_adapter: an nn.Module, got {type(adapter).__name__}")
        if param_name in self.lora:
            raise ValueError(f"GroupedExperts.attach_adapter: {param_name!r} has an adapter already")
        self.lora[param_name] = adapter

    def detach_adapters(self) -> None:
        """Remove every attached adapter (e.g. after merging them into the weights)."""
        self.lora.clear()

    def reset_parameters(self) -> None:
        """nn.Linear's default (uniform +-1/sqrt(fan_in)) init, per expert, biases included."""
        with torch.no_grad():
            b1 = 1.0 / math.sqrt(self.hidden_size)
            b2 = 1.0 / math.sqrt(self.intermediate_size)
            self.gate_up_proj.uniform_(-b1, b1)
            self.down_proj.uniform_(-b2, b2)
            if self.gate_up_proj_bias is not None and self.down_proj_bias is not None:
                self.gate_up_proj_bias.uniform_(-b1, b1)
                self.down_proj_bias.uniform_(-b2, b2)

    def forward(self, x: Tensor, tokens_per_expert: Tensor, row_weight: Tensor | None = None) -> Tensor:
        """Apply the local experts to expert-contiguous rows.

        Args:
            x: ``[M, H]`` rows grouped by (local) expert, ``M >= tokens_per_expert.sum()`` (rows
                past the groups are not computed and their output is unspecified).
            tokens_per_expert: ``[E_local]`` int64 rows per local expert.
            row_weight: ``[M]`` optional routing weight per row, fused into the activation (by
                linearity, ``down(w * h) == w * down(h)``); with a down bias the bias is scaled by
                it too, so the row gets ``w * (down(h) + b)`` as in transformers.

        Returns:
            ``[M, H]``.
        """
        w1 = local_tensor(self.gate_up_proj)
        w2 = local_tensor(self.down_proj)
        # Attached adapters (e.g. plait.peft's expert LoRA) add their term to each grouped GEMM's
        # output, on the same expert-contiguous rows.
        adapters = self.lora
        h = self.grouped_mm(x, w1, tokens_per_expert, trans_w=True)
        if "gate_up_proj" in adapters:
            h = adapters["gate_up_proj"](h, x, tokens_per_expert, gmm=gmm)
        experts_of_rows = None
        if self.gate_up_proj_bias is not None:
            experts_of_rows = row_experts(tokens_per_expert, x.shape[0])
            h = (h.float() + _bias_rows(local_tensor(self.gate_up_proj_bias), experts_of_rows)).to(h.dtype)
        act = self.activation
        if isinstance(act, ClampedSwiGLU):
            a = clamped_swiglu(h, act.alpha, act.limit, row_weight)
        else:
            # Only the rows of the groups: a buffer sized by a static bound (the all-gather
            # dispatch's, P times what balanced routing fills) is not read or written past them.
            a = swiglu_fused(h, row_weight, num_rows=tokens_per_expert.sum())
        out = self.grouped_mm(a, w2, tokens_per_expert, trans_w=True)
        if "down_proj" in adapters:
            out = adapters["down_proj"](out, a, tokens_per_expert, gmm=gmm)
        if self.down_proj_bias is not None:
            assert experts_of_rows is not None
            b = _bias_rows(local_tensor(self.down_proj_bias), experts_of_rows)
            b = b if row_weight is None else b * row_weight.unsqueeze(-1).float()
            out = (out.float() + b).to(out.dtype)
        return out

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
            f"intermediate_size={self.intermediate_size}, activation={self.activation.kind}, "
            f"bias={self.gate_up_proj_bias is not None}"
        )


class SharedExpert(nn.Module):
    """A dense SwiGLU FFN every token goes through (Qwen2-MoE / DeepSeek shared experts)."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        """``down(silu(gate(x)) * up(x))``."""
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))
