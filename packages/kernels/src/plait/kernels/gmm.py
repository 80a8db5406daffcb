"""Grouped GEMM for MoE experts: ``y[rows of e] = x[rows of e] @ w[e]``.

Backends:

* ``"torch"``: ``torch._grouped_mm`` (CUTLASS grouped GEMM for bf16 on compute capability 9.x/10.x;
  PyTorch >= 2.15 also runs it on CPU). The default on CUDA when its fast path applies.
* ``"triton"``: plait's Triton grouped GEMM (:mod:`plait.kernels._triton.gmm`): any float dtype, any
  GPU Triton runs on, any dims; the group sizes stay on the device. The default on CUDA elsewhere.
* ``"nv"``: nv-grouped-gemm (``pip install 'plait-kernels[gmm]'``), imported lazily.
* ``"loop"``: one matmul per expert, reading the group sizes on the host; every dtype and device (the
  CPU default).

All backends share one torch op, ``plait::gmm``, a ``triton_op``: ``torch.compile`` traces its body,
so the ``"torch"`` backend's ``_grouped_mm`` and the ``"triton"`` backend's kernel are nodes of the
compiled graph (no custom-op dispatch); the host-side backends stay opaque (``plait::gmm_host``). Its backward computes ``dx`` as the forward
does (with the opposite transpose) and ``dw`` with the custom op ``plait::gmm_weight_grad``, which honours
:func:`plait.kernels.grad_direction` each time it runs: the inputs pass computes only ``dx``, the
weights pass only ``dw``. Experts with zero tokens get a zero weight gradient.
``tokens_per_expert`` may sum to fewer than ``M`` rows (a buffer sized by a static upper bound, as
:func:`plait.kernels.permute` returns): the rows past the last group are not computed and their
output values are unspecified (zero on the ``"loop"`` backend).
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from plait.kernels._dispatch import use_triton
from plait.kernels.grad_direction import _returned, _weights_wanted

__all__ = ["gmm", "gmm_reference"]

Backend = Literal["auto", "torch", "triton", "nv", "loop"]


def gmm_reference(
    x: torch.Tensor, w: torch.Tensor, tokens_per_expert: torch.Tensor, trans_w: bool = False
) -> torch.Tensor:
    """Loop-over-experts reference (plain autograd)."""
    outs = []
    start = 0
    for e, cnt in enumerate(tokens_per_expert.tolist()):
        we = w[e].T if trans_w else w[e]
        outs.append(x[start : start + cnt] @ we)
        start += cnt
    n = w.shape[1] if trans_w else w.shape[2]
    return torch.cat(outs) if outs else x.new_zeros((0, n))


# --- primitives: y = x @ w_e (w [E,K,N]), or x @ w_e^T (w [E,N,K]); dw for each layout -------------


def _loop_mm(a: torch.Tensor, b: torch.Tensor, counts: list[int], trans_b: bool) -> torch.Tensor:
    n = b.shape[1] if trans_b else b.shape[2]
    out = a.new_empty((a.shape[0], n))
    start = 0
    for e, cnt in enumerate(counts):
        if cnt:
            torch.mm(a[start : start + cnt], b[e].T if trans_b else b[e], out=out[start : start + cnt])
        start += cnt
    out[start:] = 0  # rows past the groups (uncomputed, like the other backends; zero here)
    return out


def _loop_dw(x: torch.Tensor, dy: torch.Tensor, counts: list[int], trans_w: bool) -> torch.Tensor:
    e_, k, n = len(counts), x.shape[1], dy.shape[1]
    dw = x.new_zeros((e_, n, k) if trans_w else (e_, k, n))
    start = 0
    for e, cnt in enumerate(counts):
        if cnt:
            xs, ds = x[start : start + cnt], dy[start : start + cnt]
            torch.mm(ds.T, xs, out=dw[e]) if trans_w else torch.mm(xs.T, ds, out=dw[e])
        start += cnt
    return dw


def _offsets(tpe: torch.Tensor, device: torch.device) -> torch.Tensor:
    return torch.cumsum(tpe.to(device=device), 0).to(torch.int32)


def _torch_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, trans_b: bool) -> torch.Tensor:
    return torch._grouped_mm(a, b.transpose(-2, -1) if trans_b else b, offs=offs)


def _torch_dw(x: torch.Tensor, dy: torch.Tensor, offs: torch.Tensor, trans_w: bool) -> torch.Tensor:
    # The "2d x 2d" grouped_mm form groups along K: one [K, N] product per expert.
    if trans_w:
        return torch._grouped_mm(dy.T, x, offs=offs)
    return torch._grouped_mm(x.T, dy, offs=offs)


def _nv():  # type: ignore[no-untyped-def]
    try:
        from grouped_gemm import backend as nv_backend
    except ImportError as e:
        raise ImportError("gmm(backend='nv') needs nv-grouped-gemm: pip install 'plait-kernels[gmm]'") from e
    return nv_backend


def _resolve(backend: str, x: torch.Tensor, w: torch.Tensor) -> str:
    if backend == "auto":
        if _torch_path(x, w):
            return "torch"
        return "triton" if x.is_cuda and use_triton(x, w) else "loop"
    return backend


def _counts(tpe: torch.Tensor, rows: int) -> list[int]:
    counts = [int(c) for c in tpe.tolist()]
    if sum(counts) > rows:
        raise ValueError(f"gmm: tokens_per_expert sums to {sum(counts)} but x has only {rows} rows")
    return counts


def _host_counts(tpe: torch.Tensor, backend: str, rows: int) -> Any:
    """The group sizes the host-side backends take: a CPU int64 tensor (``"nv"``) or a list (``"loop"``).

    Raises:
        RuntimeError: a CUDA graph is being captured, which cannot read device values on the host.
    """
    if tpe.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"gmm: the {backend!r} backend reads tokens_per_expert on the host, which a CUDA graph being "
            "captured cannot do; the 'triton' and 'torch' backends keep them on the device ('auto' takes "
            "them unless Triton is missing or PLAIT_KERNELS_DISABLE_TRITON=1)"
        )
    return tpe.to("cpu", torch.int64) if backend == "nv" else _counts(tpe, rows)


@torch.library.custom_op(
    "plait::gmm_host",
    mutates_args=(),
    schema="(Tensor x, Tensor w, Tensor tokens_per_expert, bool trans_w, str backend) -> Tensor",
)
def _gmm_host_op(
    x: torch.Tensor, w: torch.Tensor, tpe: torch.Tensor, trans_w: bool, backend: str
) -> torch.Tensor:
    """The backends that read the group sizes on the host (``"loop"``, ``"nv"``): opaque to the compiler."""
    counts = _host_counts(tpe, backend, x.shape[0])
    if backend == "nv":
        return _nv().gmm(x, w, counts, trans_a=False, trans_b=trans_w)
    return _loop_mm(x, w, counts, trans_w)


@_gmm_host_op.register_fake
def _(x: torch.Tensor, w: torch.Tensor, tpe: Any, trans_w: bool, backend: str) -> torch.Tensor:
    return x.new_empty((x.shape[0], w.shape[1] if trans_w else w.shape[2]))


def _gmm_impl(
    x: torch.Tensor, w: torch.Tensor, tpe: torch.Tensor, trans_w: bool, backend: str
) -> torch.Tensor:
    """``[M, N]``; rows past ``tokens_per_expert.sum()`` are not computed."""
    backend = _resolve(backend, x, w)
    if backend == "torch":
        return _torch_mm(x, w, _offsets(tpe, x.device), trans_w)
    if backend == "triton":
        from plait.kernels._triton.gmm import grouped_mm

        return grouped_mm(x, w, tpe, trans_w)
    return _gmm_host_op(x, w, tpe, trans_w, backend)  # type: ignore[no-any-return]


# A triton_op, not a custom_op: torch.compile traces its body, so the "torch" backend's grouped GEMM
# (and its offsets) become plain nodes of the compiled graph, called without the custom-op dispatcher
# (~100 us of host time per call). The host-side backends stay opaque (plait::gmm_host).
@torch.library.triton_op(
    "plait::gmm",
    mutates_args=(),
    schema="(Tensor x, Tensor w, Tensor tokens_per_expert, bool trans_w, str backend) -> Tensor",
)
def _gmm_op(x: torch.Tensor, w: torch.Tensor, tpe: torch.Tensor, trans_w: bool, backend: str) -> torch.Tensor:
    return _gmm_impl(x, w, tpe, trans_w, backend)


@torch.library.custom_op(
    "plait::gmm_weight_grad",
    mutates_args=(),
    schema="(Tensor dy, Tensor x, Tensor w, Tensor tokens_per_expert, bool trans_w, str backend) -> Tensor",
)
def _gmm_dw_op(
    dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, tpe: torch.Tensor, trans_w: bool, backend: str
) -> torch.Tensor:
    """``dw`` (``w``'s shape), zero when the grad-direction switch is off for weights.

    A custom op, opaque to the compiler, so that the switch is read each time a compiled backward runs
    (:mod:`plait.kernels.grad_direction`).
    """
    if not _weights_wanted(True):
        return torch.zeros_like(w)
    backend = _resolve(backend, x, w)
    if backend == "torch":
        offs = _offsets(tpe, x.device)
        dw = _torch_dw(x, dy, offs, trans_w)
        if not dw.is_cuda:
            # The CPU kernel's handling of empty groups is not documented: zero them here
            # (free on CPU). The CUDA (CUTLASS) kernel writes zeros for K=0 groups (checked on
            # torch 2.11 / H100 and by the gpu test); a sync or a masked pass there would
            # cost a stall or ~2x the GEMM's bytes.
            empty = torch.nonzero(torch.diff(offs, prepend=offs.new_zeros(1)) == 0).flatten()
            if empty.numel():
                dw.index_fill_(0, empty, 0)
        return dw
    if backend == "triton":
        from plait.kernels._triton.gmm import grouped_weight_grad

        return grouped_weight_grad(x, dy, tpe, trans_w)
    counts = _host_counts(tpe, backend, x.shape[0])
    if backend == "nv":
        nv = _nv()
        return nv.gmm(dy, x, counts, trans_a=True) if trans_w else nv.gmm(x, dy, counts, trans_a=True)
    return _loop_dw(x, dy, counts, trans_w)


@_gmm_dw_op.register_fake
def _(dy: Any, x: Any, w: torch.Tensor, tpe: Any, trans_w: bool, backend: str) -> torch.Tensor:
    return w.new_empty(w.shape)


def _setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    x, w, tpe, trans_w, backend = inputs
    ctx.save_for_backward(x, w, tpe)
    ctx.trans_w, ctx.backend = trans_w, backend


def _backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
    x, w, tpe = ctx.saved_tensors
    need_dx, need_dw = _returned(ctx.needs_input_grad[0], ctx.needs_input_grad[1])
    dy = dy.contiguous()
    # dx = dy @ w_e^T: the forward's body with the opposite transpose, called directly (traced like
    # the forward under torch.compile; no second dispatch in eager).
    dx = _gmm_impl(dy, w, tpe, not ctx.trans_w, ctx.backend) if need_dx else None
    dw = _gmm_dw_op(dy, x, w, tpe, ctx.trans_w, ctx.backend) if need_dw else None
    return dx, dw, None, None, None


_gmm_op.register_autograd(_backward, setup_context=_setup)


def _torch_path(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``"auto"`` takes ``torch._grouped_mm``: where its CUTLASS kernel runs (compute capability
    9.x or 10.x, as torch's own gate: elsewhere torch loops over the groups on the host; bf16 operands,
    16-byte aligned rows, i.e. dims that are multiples of 8)."""
    return (
        hasattr(torch, "_grouped_mm")
        and x.is_cuda
        and torch.cuda.get_device_capability(x.device)[0] in (9, 10)
        and x.dtype == w.dtype == torch.bfloat16
        and not (x.shape[1] % 8 or w.shape[1] % 8 or w.shape[2] % 8)
    )


def gmm(
    x: torch.Tensor,
    w: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    trans_w: bool = False,
    backend: Backend = "auto",
) -> torch.Tensor:
    """Grouped matmul over experts.

    Args:
        x: ``[M, K]``, rows grouped contiguously by expert (expert 0's rows first).
        w: ``[E, K, N]``, or ``[E, N, K]`` with ``trans_w=True`` (the ``nn.Linear`` layout).
        tokens_per_expert: ``[E]`` integer row counts summing to at most ``M`` (zeros allowed; rows
            past the sum are not computed). The ``"loop"`` backend reads them on the host.
        trans_w: whether ``w`` is stored ``[E, N, K]``.
        backend: ``"auto"`` (``torch._grouped_mm`` for bf16 on compute capability 9.x/10.x with
            16-byte-aligned dims, else ``"triton"`` on CUDA, else ``"loop"``), ``"torch"``, ``"triton"``,
            ``"nv"`` (extra ``plait-kernels[gmm]``) or ``"loop"``.

    Returns:
        ``[M, N]`` in ``x.dtype``.
    """
    if x.dim() != 2 or w.dim() != 3:
        raise ValueError(
            f"gmm: x must be [M, K] and w [E, K, N] / [E, N, K]; got {tuple(x.shape)}, {tuple(w.shape)}"
        )
    k = w.shape[2] if trans_w else w.shape[1]
    if x.shape[1] != k:
        raise ValueError(f"gmm: x has K={x.shape[1]} but w {tuple(w.shape)} (trans_w={trans_w}) has K={k}")
    if tokens_per_expert.dim() != 1 or tokens_per_expert.shape[0] != w.shape[0]:
        raise ValueError(
            f"gmm: tokens_per_expert {tuple(tokens_per_expert.shape)} must be [{w.shape[0]}] (one count per expert)"
        )
    if tokens_per_expert.dtype.is_floating_point:
        raise ValueError(f"gmm: tokens_per_expert must be an integer tensor, got {tokens_per_expert.dtype}")
    if x.dtype != w.dtype:
        raise ValueError(f"gmm: x dtype {x.dtype} != w dtype {w.dtype}")
    if backend == "nv":
        _nv()
    elif backend == "torch" and not hasattr(torch, "_grouped_mm"):
        raise RuntimeError(
            f"gmm(backend='torch') needs torch._grouped_mm (torch {torch.__version__} lacks it)"
        )
    elif backend == "triton" and not use_triton(x, w, tokens_per_expert):
        raise RuntimeError(
            "gmm(backend='triton') needs triton and CUDA tensors (CPU ones under TRITON_INTERPRET=1), "
            "and PLAIT_KERNELS_DISABLE_TRITON unset"
        )
    elif backend not in ("auto", "torch", "triton", "loop"):
        raise ValueError(
            f"gmm: unknown backend {backend!r} (expected 'auto', 'torch', 'triton', 'nv' or 'loop')"
        )
    return _gmm_op(x, w, tokens_per_expert, trans_w, backend)  # type: ignore[no-any-return]
