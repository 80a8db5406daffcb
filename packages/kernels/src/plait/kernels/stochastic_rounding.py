"""Stochastic rounding fp32 -> bf16 and :class:`StochasticAdamW`, AdamW for bf16 parameters.

Rounding a value to bf16 stochastically (up with probability proportional to the distance from the
lower neighbour) is unbiased: ``E[round(x)] == x``. That keeps tiny AdamW updates, which
round-to-nearest would drop entirely on bf16 weights, alive in expectation; bf16 weights then track
an fp32-master-weight run without storing fp32 masters.

Implementation: add 16 random bits to the fp32 bit pattern and truncate to the top 16 bits (the
bf16 value). Random bits come from a generator owned by the optimizer; the Triton kernel turns one
seed per tensor per step into Philox streams.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from plait.kernels._dispatch import use_triton
from torch.optim import Optimizer

__all__ = ["StochasticAdamW", "stochastic_round"]

_SEED_MAX = 2**31 - 1


def _random_bits(shape: torch.Size, seed: int, device: torch.device) -> torch.Tensor:
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return torch.randint(0, 1 << 16, shape, dtype=torch.int32, device=device, generator=g)


def _round_bits_torch(x: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    i = x.float().contiguous().view(torch.int32)
    i = (i + bits) & -65536  # keep the top 16 bits: sign, exponent, 7 mantissa bits
    return (i >> 16).to(torch.int16).view(torch.bfloat16)


def stochastic_round(x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Round a float tensor to bf16 stochastically (unbiased).

    Args:
        x: tensor of any float dtype (upcast to fp32 first).
        generator: CPU ``torch.Generator`` drawing the per-call seed (default: the global one).

    Returns:
        bf16 tensor of ``x.shape``.
    """
    seed = int(torch.randint(0, _SEED_MAX, (1,), generator=generator).item())
    xf = x.float().contiguous()
    if use_triton(xf):
        from plait.kernels._triton.stochastic_rounding import stochastic_round_triton

        return stochastic_round_triton(xf, seed)
    return _round_bits_torch(xf, _random_bits(xf.shape, seed, xf.device))


def _local(t: torch.Tensor) -> torch.Tensor:
    # DTensor parameters (FSDP2, TP): update the local shard in place.
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


_TRITON_DTYPES = (torch.float32, torch.bfloat16)


def wide_access(*tensors: torch.Tensor) -> bool:
    """Whether the Triton step may move 16 bytes per access of these tensors (of one numel): every
    address a multiple of 16 bytes and the numel of 16 elements. The step launches such tensors
    apart from the others, which take narrow accesses."""
    return tensors[0].numel() % 16 == 0 and all(t.data_ptr() % 16 == 0 for t in tensors)


def _hyper(group: dict[str, Any], t: float) -> dict[str, float]:
    """A param group's AdamW hyperparameters at step ``t`` (bias corrections included)."""
    b1, b2 = group["betas"]
    return {
        "lr": float(group["lr"]), "b1": float(b1), "b2": float(b2), "eps": float(group["eps"]),
        "wd": float(group["weight_decay"]), "bc1": 1 - b1**t, "bc2": 1 - b2**t,
    }  # fmt: skip


def _adamw_torch(
    p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, *, lr: float, b1: float, b2: float,
    eps: float, wd: float, bc1: float, bc2: float, seed: int, grad_scale: torch.Tensor | None,
) -> None:  # fmt: skip
    gf = g.float() if grad_scale is None else g.float() * grad_scale.to(g.device, torch.float32)
    mf = m.float().mul_(b1).add_(gf, alpha=1 - b1)
    vf = v.float().mul_(b2).addcmul_(gf, gf, value=1 - b2)
    pf = p.float().mul_(1 - lr * wd)
    pf.addcdiv_(mf / bc1, (vf / bc2).sqrt_().add_(eps), value=-lr)
    gen = torch.Generator(device=p.device)
    gen.manual_seed(seed)

    def store(dst: torch.Tensor, val: torch.Tensor) -> None:
        if dst.dtype == torch.bfloat16:
            bits = torch.randint(0, 1 << 16, val.shape, dtype=torch.int32, device=val.device, generator=gen)
            dst.copy_(_round_bits_torch(val, bits))
        else:
            dst.copy_(val)

    store(p, pf)
    store(m, mf)
    store(v, vf)


class StochasticAdamW(Optimizer):
    """AdamW whose bf16 parameters (and optional bf16 moments) are written with stochastic rounding.

    Decoupled weight decay (``p -= lr * wd * p``) and bias correction as in ``torch.optim.AdamW``.
    fp32 parameters are updated exactly (no rounding needed). On CUDA one fused Triton kernel reads
    ``p, g, m, v`` once and writes ``p, m, v`` once, for all the parameters of a param group in one
    launch (per combination of dtypes; fp16 or non-contiguous tensors take the PyTorch path): the
    host's cost of a step is a few microseconds per parameter, not a kernel launch each.

    Gradient clipping inside the step: ``step(grad_scale=factor)`` multiplies every gradient by
    ``factor`` (a 0-d device tensor, e.g. :func:`plait.dist_core.clip_factor` of the global norm) as
    the kernel reads it, instead of a separate pass that rewrites the gradients
    (``torch.nn.utils.clip_grad_norm_``'s ``_foreach_mul_``). The gradients are left unscaled.

    Randomness: the optimizer owns a CPU ``torch.Generator`` seeded with ``seed``; each step draws
    one seed per parameter from it. Give every data-parallel replica the same ``seed`` and their
    replicated parameters stay bit-identical. The generator state is part of ``state_dict()``
    (key ``"rng_state"``) so resuming continues the same random stream.

    Args:
        params: parameters or param groups.
        lr: learning rate.
        betas: ``(beta1, beta2)``.
        eps: denominator epsilon.
        weight_decay: decoupled weight decay coefficient.
        moment_dtype: ``torch.float32`` (default) or ``torch.bfloat16`` for ``exp_avg``/``exp_avg_sq``.
        seed: generator seed; ``None`` draws one from torch's global generator (differs per process
            unless seeded the same way).
    """

    #: The optimizer capability a training loop looks for: ``step(grad_scale=...)`` clips in the step.
    step_takes_grad_scale: ClassVar[bool] = True

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        moment_dtype: torch.dtype = torch.float32,
        seed: int | None = None,
    ) -> None:
        if lr < 0:
            raise ValueError(f"StochasticAdamW: invalid lr {lr}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"StochasticAdamW: invalid betas {betas}")
        if eps < 0 or weight_decay < 0:
            raise ValueError(f"StochasticAdamW: invalid eps {eps} / weight_decay {weight_decay}")
        if moment_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"StochasticAdamW: moment_dtype must be float32 or bfloat16, got {moment_dtype}")
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "moment_dtype": moment_dtype,
        }
        super().__init__(params, defaults)
        if seed is None:
            seed = int(torch.randint(0, _SEED_MAX, (1,)).item())
        self.generator = torch.Generator()
        self.generator.manual_seed(seed)

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        sd["rng_state"] = self.generator.get_state()
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        rng = state_dict.pop("rng_state", None)
        # torch.optim casts floating state to the parameter's dtype on load; moments keep their own
        # dtype here (fp32 moments of bf16 weights must not be rounded to bf16), so restore them.
        moments = {
            pid: {k: v for k, v in st.items() if k != "step" and isinstance(v, torch.Tensor)}
            for pid, st in state_dict.get("state", {}).items()
        }
        super().load_state_dict(state_dict)
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for pid, p in zip(ids, params):
            for k, v in moments.get(pid, {}).items():
                self.state[p][k] = v.detach().to(device=p.device, copy=True)
        if rng is not None:
            self.generator.set_state(rng)

    def _state(self, p: torch.Tensor, moment_dtype: torch.dtype) -> dict[str, Any]:
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, dtype=moment_dtype, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=moment_dtype, memory_format=torch.preserve_format)
        return state

    @torch.no_grad()
    def step(self, closure: Any = None, *, grad_scale: torch.Tensor | None = None) -> Any:  # type: ignore[override]
        """One AdamW step; ``grad_scale`` (a 0-d tensor) multiplies every gradient as it is read."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if any(p.grad.is_sparse for p in params):
                raise RuntimeError("StochasticAdamW does not support sparse gradients")
            if not params:
                continue
            states = [self._state(p, group["moment_dtype"]) for p in params]
            steps = [st["step"] for st in states]
            torch._foreach_add_(steps, 1)
            # One draw for the group: the same stream as one draw per parameter, in order.
            seeds = torch.randint(0, _SEED_MAX, (len(params),), generator=self.generator).tolist()
            quads = [
                (_local(p), _local(p.grad), _local(st["exp_avg"]), _local(st["exp_avg_sq"]))
                for p, st in zip(params, states)
            ]
            every_triton = use_triton(*(x for q in quads for x in q))
            # Tensors the Triton kernel takes, one launch per (step, device, dtypes, 16-byte alignment):
            # the host cost of a step is then a few microseconds per parameter, not a kernel launch each.
            launches: dict[tuple[Any, ...], list[Any]] = {}
            for (pl, gl, ml, vl), step, seed in zip(quads, steps, seeds):
                if pl.numel() == 0:
                    continue
                t = float(step)
                if (
                    (every_triton or use_triton(pl, gl, ml, vl))
                    and all(x.is_contiguous() and x.dtype in _TRITON_DTYPES for x in (pl, gl, ml, vl))
                    and pl.device == gl.device == ml.device
                ):
                    key = (t, pl.device, pl.dtype, gl.dtype, ml.dtype, wide_access(pl, gl, ml, vl))
                    launches.setdefault(key, []).append((pl, gl, ml, vl, seed))
                    continue
                _adamw_torch(pl, gl, ml, vl, grad_scale=grad_scale, seed=seed, **_hyper(group, t))
            for (t, *_, wide), tensors in launches.items():
                from plait.kernels._triton.stochastic_rounding import adamw_triton

                adamw_triton(tensors, grad_scale=grad_scale, wide=wide, **_hyper(group, t))
        return loss
