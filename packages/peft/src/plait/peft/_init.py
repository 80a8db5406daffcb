"""Adapter initialisations, computed as whole (unsharded) tensors so that a sharded model draws
exactly the numbers a single process draws with the same seed."""

from __future__ import annotations

import math

import torch
from plait.model_state import full_tensor, local_view
from plait.peft._dtensor import assign_full
from plait.peft.config import LoRAInit

__all__ = ["init_factors", "pissa_factors"]


def init_factors(
    init: LoRAInit,
    a_shape: tuple[int, ...],
    b_shape: tuple[int, ...],
    *,
    fan_in: int,
    r: int,
    device: torch.device,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 ``(A, B)`` for the random initialisations (PiSSA: :func:`pissa_factors`).

    ``kaiming``/``random``: A ~ U(+-1/sqrt(fan_in)) (Kaiming-uniform with a=sqrt(5), nn.Linear's
    default); ``gaussian``: A ~ N(0, 1/r). B = 0, except ``random``: B ~ U(+-1/sqrt(r)).
    """
    if init == "pissa":
        raise ValueError("init_factors: PiSSA is computed from the base weight (pissa_factors)")
    # Drawn on the generator's device (the CPU without one) and then moved: the numbers do not depend on
    # the target device nor on the CUDA generator's offset, which DTensor's RNG tracker advances
    # differently from plain-tensor ops, so a sharded CUDA run would otherwise draw other adapters.
    draw = generator.device if generator is not None else torch.device("cpu")
    a = torch.empty(a_shape, device=draw)
    if init == "gaussian":
        a.normal_(0.0, 1.0 / r, generator=generator)
    else:
        bound = 1.0 / math.sqrt(fan_in)
        a.uniform_(-bound, bound, generator=generator)
    b = torch.zeros(b_shape, device=draw)
    if init == "random":
        bound = 1.0 / math.sqrt(r)
        b.uniform_(-bound, bound, generator=generator)
    return a.to(device), b.to(device)


def pissa_factors(
    weight: torch.Tensor, r: int, scaling: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PiSSA: ``(A, B, residual)`` from the top-r SVD of ``weight`` (``[out, in]`` or batched ``[E, out, in]``).

    ``A = sqrt(S_r / s) V_r^T``, ``B = U_r sqrt(S_r / s)``, ``residual = W - s B A`` (all float32),
    so the forward is unchanged at init.
    """
    if weight.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"PiSSA init needs a float32/float16/bfloat16 base weight, got {weight.dtype}")
    w = weight.detach().float()
    u, s, vh = torch.linalg.svd(w, full_matrices=False)
    sr = (s[..., :r] / scaling).sqrt()
    a = sr.unsqueeze(-1) * vh[..., :r, :]
    b = u[..., :, :r] * sr.unsqueeze(-2)
    return a, b, w - scaling * (b @ a)


def init_adapter(
    a: torch.Tensor,
    b: torch.Tensor,
    weight: torch.Tensor | None,
    *,
    init: LoRAInit,
    r: int,
    scaling: float,
    fan_in: int,
    generator: torch.Generator | None,
) -> None:
    """Fill the factors ``a``, ``b`` (plain or DTensor) per ``init``; PiSSA also rewrites ``weight``.

    Whole tensors are drawn on every rank and each keeps its shard, so sharded and single-process
    initialisations agree for the same seed.
    """
    if init == "pissa":
        assert weight is not None
        fa, fb, residual = pissa_factors(full_tensor(weight), r, scaling)
        assign_full(weight, residual)
    else:
        fa, fb = init_factors(
            init,
            tuple(a.shape),
            tuple(b.shape),
            fan_in=fan_in,
            r=r,
            device=local_view(a).device,
            generator=generator,
        )
    assign_full(a, fa)
    assign_full(b, fb)
