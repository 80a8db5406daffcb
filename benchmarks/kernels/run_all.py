"""Benchmark every plait kernel against torch eager, torch.compile and Liger / cut-cross-entropy.

One command on a GPU machine:

    python3 -m benchmarks.run --suite kernels          # sets PYTHONPATH, writes benchmarks/results/kernels.md
    PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python3 -m benchmarks.kernels.run_all [--quick] [--md out.md]
    PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python3 -m benchmarks.kernels.run_all --check

Times are medians of one call each, the L2 cache flushed before every call. ``--timing device``
(default) keeps host dispatch out of the measurement (the GPU waits after the flush until the call is
queued), so a row's time does not depend on the measuring CPU; ``--timing launch`` is
``triton.testing.do_bench``, which also counts any host time of the call that the flush kernel does
not hide (what made memory-bound rows of eager custom ops vary run to run).

``--check`` runs every row three times and compares the median time of each row with the committed
``benchmarks/results/kernels.md`` (by its ``id`` column): it exits 1 naming every row more than 5% slower.
With ``--md`` it also writes the table of those medians (the refreshed table to commit).

Prints one table: per kernel and shape, each implementation's time, its GB/s (memory-bound ops,
counting the minimum bytes: each input read once, each output written once) or TFLOP/s (GEMMs),
the fraction of the copy bandwidth / bf16 matmul rate measured in the same run, and for linear-CE
the peak extra memory. Liger-Kernel and cut-cross-entropy are used when importable.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.testing
from plait.kernels import (
    GradDirection,
    StochasticAdamW,
    gmm,
    grad_direction,
    linear_cross_entropy,
    permute,
    rms_norm,
    swiglu,
)

from benchmarks.regression import (
    device_mismatch,
    median_rows,
    parse_table,
    regressions,
    report,
    row_id,
)

ROWS: list[dict[str, Any]] = []
DEV = "cuda"
RESULTS = Path(__file__).resolve().parents[1] / "results" / "kernels.md"
CHECK_RUNS = 3


TIMING = "device"  # --timing
_SLEEP_CYCLES: list[int] = []  # GPU clock cycles of a 1 ms torch.cuda._sleep, measured once


def _sleep_cycles_per_ms() -> int:
    if not _SLEEP_CYCLES:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1_000_000)  # warm-up
        start.record()
        torch.cuda._sleep(10_000_000)
        end.record()
        torch.cuda.synchronize()
        _SLEEP_CYCLES.append(int(10_000_000 / start.elapsed_time(end)))
    return _SLEEP_CYCLES[0]


def bench(fn: Callable[[], Any], rep: int = 100) -> float:
    """Median time of one call of ``fn`` in ms, the L2 cache flushed before each call.

    ``--timing device`` (default): after the flush the GPU waits 1 ms (``torch.cuda._sleep``) before
    the start event, so that the host has queued the whole call by the time it starts: host
    dispatch (Python, custom-op and autograd overhead, kernel launches) never lands between the
    events, and a row's time does not depend on how fast or busy the measuring process's CPU is.
    ``--timing launch``: ``triton.testing.do_bench`` as before, whose events also catch whatever host
    time of the call the flush kernel does not cover (host cost shows in the training benchmarks).
    """
    if TIMING == "launch":
        return float(triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median"))
    flush = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device=DEV)  # do_bench's 256 MB
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        flush.zero_()
        fn()
    end.record()
    torch.cuda.synchronize()
    est = max(start.elapsed_time(end) / 5, 1e-3)
    for _ in range(max(1, int(25 / est))):
        fn()
    n = max(5, min(1000, int(rep / est)))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    wait = _sleep_cycles_per_ms()
    for i in range(n):
        flush.zero_()
        torch.cuda._sleep(wait)
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True))
    return float(times[len(times) // 2])


def add(
    kernel: str,
    shape: str,
    impl: str,
    ms: float | None,
    *,
    nbytes: float = 0,
    flops: float = 0,
    mem: float | None = None,
    note: str = "",
) -> None:
    ROWS.append(
        {
            "kernel": kernel,
            "shape": shape,
            "impl": impl,
            "ms": ms,
            "bytes": nbytes,
            "flops": flops,
            "mem": mem,
            "note": note,
        }
    )


def attempt(kernel: str, shape: str, impl: str, make: Callable[[], Callable[[], Any]], **kw: Any) -> None:
    try:
        fn = make()
        ms = bench(fn)
        add(kernel, shape, impl, ms, **kw)
    except Exception as e:  # a baseline that cannot run is reported, not fatal
        add(kernel, shape, impl, None, note=f"{type(e).__name__}: {str(e)[:80]}")
    finally:
        gc.collect()
        torch.cuda.empty_cache()


def ceilings() -> tuple[float, float]:
    n = 1 << 29  # 1 GiB of bf16
    a = torch.empty(n, dtype=torch.bfloat16, device=DEV).normal_()
    b = torch.empty_like(a)
    ms = bench(lambda: b.copy_(a))
    copy_gbs = 2 * a.numel() * 2 / ms / 1e6
    x = torch.randn(8192, 8192, dtype=torch.bfloat16, device=DEV)
    y = torch.randn(8192, 8192, dtype=torch.bfloat16, device=DEV)
    ms = bench(lambda: x @ y)
    mm_tfs = 2 * 8192**3 / ms / 1e9
    return copy_gbs, mm_tfs


def _liger(name: str) -> Any:
    import importlib

    mod, attr = name.rsplit(".", 1)
    return getattr(importlib.import_module(mod), attr)


def _bwd(y: torch.Tensor, inputs: tuple[torch.Tensor, ...], dy: torch.Tensor) -> Callable[[], Any]:
    return lambda: torch.autograd.grad(y, inputs, dy, retain_graph=True)


# --------------------------------------------------------------------------------------------


def bench_swiglu(quick: bool) -> None:
    r, c = (4096, 8192) if quick else (16384, 8192)
    shape = f"{r}x{c}"
    g = torch.randn(r, c, dtype=torch.bfloat16, device=DEV, requires_grad=True)
    u = torch.randn(r, c, dtype=torch.bfloat16, device=DEV, requires_grad=True)
    dy = torch.randn(r, c, dtype=torch.bfloat16, device=DEV)
    n = r * c * 2
    eager = lambda a, b: F.silu(a) * b  # noqa: E731
    comp = torch.compile(eager)
    impls: dict[str, Callable[..., torch.Tensor]] = {"plait": swiglu, "eager": eager, "compile": comp}
    with contextlib.suppress(Exception):
        liger = _liger("liger_kernel.ops.swiglu.LigerSiLUMulFunction")
        impls["liger"] = liger.apply
    for name, f in impls.items():
        attempt("swiglu fwd", shape, name, lambda f=f: lambda: f(g, u), nbytes=3 * n)
        attempt("swiglu bwd", shape, name, lambda f=f: _bwd(f(g, u), (g, u), dy), nbytes=5 * n)
    # fused MoE probability: plait fuses the row weight; eager/compile pay for it
    w = torch.rand(r, device=DEV, requires_grad=True)
    eager_w = lambda a, b, p: F.silu(a) * b * p[:, None].to(a.dtype)  # noqa: E731
    comp_w = torch.compile(eager_w)
    for name, f in {"plait": swiglu, "eager": eager_w, "compile": comp_w}.items():
        attempt(
            "swiglu*prob fwd+bwd",
            shape,
            name,
            lambda f=f: lambda: torch.autograd.grad(f(g, u, w), (g, u, w), dy),
            nbytes=8 * n,
        )


def bench_rms_norm(quick: bool) -> None:
    r, c = (8192, 4096) if quick else (32768, 4096)
    shape = f"{r}x{c}"
    x = torch.randn(r, c, dtype=torch.bfloat16, device=DEV, requires_grad=True)
    w = torch.randn(c, dtype=torch.bfloat16, device=DEV, requires_grad=True)
    res = torch.randn(r, c, dtype=torch.bfloat16, device=DEV, requires_grad=True)
    dy = torch.randn(r, c, dtype=torch.bfloat16, device=DEV)
    n = r * c * 2
    eager = lambda a, b: F.rms_norm(a, (c,), b, 1e-6)  # noqa: E731
    comp = torch.compile(eager)
    impls: dict[str, Callable[..., torch.Tensor]] = {
        "plait": lambda a, b: rms_norm(a, b, 1e-6),
        "eager": eager,
        "compile": comp,
    }
    with contextlib.suppress(Exception):
        lrms = _liger("liger_kernel.ops.rms_norm.LigerRMSNormFunction")
        impls["liger"] = lambda a, b: lrms.apply(a, b, 1e-6, 0.0, "llama", False)
    for name, f in impls.items():
        attempt("rms_norm fwd", shape, name, lambda f=f: lambda: f(x, w), nbytes=2 * n)
        attempt("rms_norm bwd", shape, name, lambda f=f: _bwd(f(x, w), (x, w), dy), nbytes=3 * n)

    # fused residual add: h = x + res; y = norm(h) -> (y, h); fwd+bwd end to end
    def eager_res(a, b, rr):
        h = a + rr
        return F.rms_norm(h, (c,), b, 1e-6), h

    comp_res = torch.compile(eager_res)
    impls_r = {
        "plait": lambda a, b, rr: rms_norm(a, b, 1e-6, residual=rr),
        "eager": eager_res,
        "compile": comp_res,
    }
    for name, f in impls_r.items():

        def mk(f=f):
            def run():
                y, h = f(x, w, res)
                torch.autograd.grad((y, h), (x, w, res), (dy, dy))

            return run

        # minimum bytes: fwd read x,res write y,h; bwd read dy,dh,h write dx (= dres)
        attempt("rms_norm+residual fwd+bwd", shape, name, mk, nbytes=8 * n)


def _model_shapes(quick: bool) -> list[tuple[int, ...]]:
    """The parameter shapes of a Qwen3-MoE (hidden 1024, 64 experts of FFN 512, vocab 151936): one step
    over a model's many tensors, each with its own address and a partial last block (quick: 1 layer and
    a smaller vocabulary; else 2 layers, ~0.6B parameters)."""
    h, e, f, kv = 1024, 64, 512, 256
    layer = [(h,), (h,), (h, h), (kv, h), (kv, h), (64,), (64,), (h, h), (e, h), (e, 2 * f, h), (e, h, f)]
    vocab = 32000 if quick else 151936
    return [(vocab, h), *(layer * (1 if quick else 2)), (h,), (vocab, h)]


def bench_adamw(quick: bool) -> None:
    n = (1 << 26) if quick else (1 << 28)
    model = _model_shapes(quick)
    model_n = sum(math.prod(s) for s in model)
    for label, pdtype, mdtype, per_elem in (
        ("fp32 states", torch.bfloat16, torch.float32, 22),
        ("bf16 states", torch.bfloat16, torch.bfloat16, 14),
    ):
        tdt = torch.float32 if mdtype == torch.float32 else torch.bfloat16
        torch_bytes = 28 if tdt == torch.float32 else 14
        for shape, shapes, count in (
            (f"{n >> 20}M params", [(n,)], n),
            (f"{len(model)} tensors, {model_n >> 20}M params", model, model_n),
        ):
            ps = [torch.nn.Parameter(torch.randn(s, dtype=pdtype, device=DEV) * 0.02) for s in shapes]
            for p in ps:
                p.grad = torch.randn_like(p) * 1e-3
            opt = StochasticAdamW(ps, lr=1e-4, moment_dtype=mdtype, seed=0)
            attempt(
                f"adamw step ({label})", shape, "plait SR", lambda opt=opt: opt.step, nbytes=per_elem * count
            )
            del opt, ps
            gc.collect()
            torch.cuda.empty_cache()
            # torch fused AdamW on the same tensors (round-to-nearest, states in the param dtype)
            qs = [torch.nn.Parameter(torch.randn(s, dtype=tdt, device=DEV) * 0.02) for s in shapes]
            for q in qs:
                q.grad = torch.randn_like(q) * 1e-3
            o2 = torch.optim.AdamW(qs, lr=1e-4, fused=True)
            impl = f"torch fused ({'fp32' if tdt == torch.float32 else 'bf16'} all)"
            attempt(f"adamw step ({label})", shape, impl, lambda o2=o2: o2.step, nbytes=torch_bytes * count)
            del o2, qs
            gc.collect()
            torch.cuda.empty_cache()


def bench_permute(quick: bool) -> None:
    t, h, e, k = (4096 if quick else 16384), 2048, 128, 8
    shape = f"T={t} H={h} E={e} k={k}"
    x = torch.randn(t, h, dtype=torch.bfloat16, device=DEV, requires_grad=True)
    logits = torch.randn(t, e, device=DEV)
    probs, idx = logits.softmax(-1).topk(k, -1)
    m = t * k
    xp, pp, rmap, _ = permute(x, idx, e, probs)
    rows = rmap.src
    # plait: gather kernel (indices built once, reused as an MoE layer would reuse them)
    from plait.kernels._triton.permute import combine_rows, gather_rows

    attempt(
        "permute (row gather)",
        shape,
        "plait",
        lambda: lambda: gather_rows(x, rows, None),
        nbytes=2 * m * h * 2,
    )
    attempt(
        "permute (row gather)",
        shape,
        "eager index_select",
        lambda: lambda: x.index_select(0, rows),
        nbytes=2 * m * h * 2,
    )
    attempt(
        "permute (full op, incl. index build)",
        shape,
        "plait",
        lambda: lambda: permute(x, idx, e, probs),
        nbytes=2 * m * h * 2,
    )
    y = xp.detach()
    w_ts = probs.float()
    attempt(
        "unpermute (weighted combine)",
        shape,
        "plait",
        lambda: lambda: combine_rows(y, rmap.dst, w_ts),
        nbytes=(m + t) * h * 2,
    )

    def eager_unperm():
        out = torch.zeros(t, h, dtype=torch.float32, device=DEV)
        out.index_add_(0, rows, y.float() * pp.detach()[:, None])
        return out.to(torch.bfloat16)

    attempt(
        "unpermute (weighted combine)", shape, "eager index_add", lambda: eager_unperm, nbytes=(m + t) * h * 2
    )


def bench_lce(quick: bool) -> None:
    n, h, v = (2048, 4096, 151936) if quick else (8192, 4096, 151936)
    shape = f"N={n} H={h} V={v}"
    x = (torch.randn(n, h, device=DEV) * 0.5).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(v, h, device=DEV) * 0.02).to(torch.bfloat16).requires_grad_()
    t = torch.randint(0, v, (n,), device=DEV)
    flops = 3 * 2 * n * h * v

    def eager():
        return F.cross_entropy((x @ w.T).float(), t)

    impls: dict[str, Callable[[], torch.Tensor]] = {
        "plait": lambda: linear_cross_entropy(x, w, t),
        "eager": eager,
    }
    try:
        flce = _liger("liger_kernel.ops.fused_linear_cross_entropy.LigerFusedLinearCrossEntropyFunction")
        impls["liger FLCE"] = lambda: flce.apply(x, w, t)[0]
    except Exception:
        pass
    try:
        from cut_cross_entropy import linear_cross_entropy as cce

        impls["cce"] = lambda: cce(x, w, t)
    except Exception:
        pass
    ref = None
    for name, f in impls.items():
        try:
            x.grad = w.grad = None
            loss = f()
            loss.backward()
            val = float(loss)
            if ref is None:
                ref = val
            note = f"loss {val:.4f} (plait {ref:.4f})"
            x.grad = w.grad = None
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            f().backward()
            torch.cuda.synchronize()
            peak = (torch.cuda.max_memory_allocated() - base) / 2**30
            x.grad = w.grad = None

            def run(f=f):
                x.grad = w.grad = None
                f().backward()

            add("linear-CE fwd+bwd", shape, name, bench(run, rep=300), flops=flops, mem=peak, note=note)
        except Exception as e:
            add("linear-CE fwd+bwd", shape, name, None, note=f"{type(e).__name__}: {str(e)[:80]}")
        x.grad = w.grad = None
        gc.collect()
        torch.cuda.empty_cache()


def bench_gmm(quick: bool) -> None:
    e, k, tokens = 128, 2048, (16384 if quick else 65536)
    for n in (768, 1536):
        shape = f"E={e} M={tokens} K={k} N={n}"
        counts = torch.distributions.Multinomial(tokens, torch.ones(e)).sample().long().to(DEV)
        x = torch.randn(tokens, k, dtype=torch.bfloat16, device=DEV, requires_grad=True)
        wt = (torch.randn(e, n, k, dtype=torch.bfloat16, device=DEV) * 0.02).requires_grad_()  # [E, N, K]
        dy = torch.randn(tokens, n, dtype=torch.bfloat16, device=DEV)
        fl = 2 * tokens * k * n
        for be in ("auto", "triton", "loop"):
            attempt(
                "gmm fwd",
                shape,
                f"plait {be}",
                lambda be=be: lambda: gmm(x, wt, counts, trans_w=True, backend=be),  # noqa: B023
                flops=fl,
            )
            attempt(
                "gmm bwd",
                shape,
                f"plait {be}",
                lambda be=be, x=x, wt=wt, c=counts, dy=dy: _bwd(
                    gmm(x, wt, c, trans_w=True, backend=be), (x, wt), dy
                ),
                flops=2 * fl,
            )
        # The split-backward passes on their own (what a zero-bubble schedule runs).
        for label, direction in (
            ("inputs only", GradDirection.INPUTS),
            ("weights only", GradDirection.WEIGHTS),
        ):

            def split(direction=direction, x=x, wt=wt, c=counts, dy=dy):
                y = gmm(x, wt, c, trans_w=True)

                def run():
                    with grad_direction(direction):
                        torch.autograd.backward(y, dy, retain_graph=True, inputs=[x, wt])
                    x.grad = wt.grad = None

                return run

            attempt(f"gmm bwd ({label})", shape, "plait auto", split, flops=fl)
        a = torch.randn(tokens, k, dtype=torch.bfloat16, device=DEV)
        b = torch.randn(k, n * 1, dtype=torch.bfloat16, device=DEV)
        attempt("gmm fwd", shape, "dense mm same FLOPs", lambda a=a, b=b: lambda: a @ b, flops=fl)
    _bench_gmm_float32(e, k, tokens // 4)


def _bench_gmm_float32(e: int, k: int, tokens: int) -> None:
    """float32 experts (where ``_grouped_mm`` does not run): the Triton kernel against the loop and a dense
    float32 GEMM of the same FLOPs, in full float32 and in TF32 (``torch.set_float32_matmul_precision``)."""
    n = 768
    counts = torch.distributions.Multinomial(tokens, torch.ones(e)).sample().long().to(DEV)
    x = torch.randn(tokens, k, device=DEV, requires_grad=True)
    wt = (torch.randn(e, n, k, device=DEV) * 0.02).requires_grad_()
    dy = torch.randn(tokens, n, device=DEV)
    a, b = torch.randn(tokens, k, device=DEV), torch.randn(k, n, device=DEV)
    fl = 2 * tokens * k * n
    before = torch.get_float32_matmul_precision()
    try:
        for precision, label in (("highest", "fp32"), ("high", "tf32")):
            torch.set_float32_matmul_precision(precision)
            shape = f"E={e} M={tokens} K={k} N={n} {label}"
            for be in ("triton", "loop"):
                fwd = lambda be=be: lambda: gmm(x, wt, counts, trans_w=True, backend=be)  # noqa: E731
                attempt("gmm fwd", shape, f"plait {be}", fwd, flops=fl)
                bwd = lambda be=be: _bwd(gmm(x, wt, counts, trans_w=True, backend=be), (x, wt), dy)  # noqa: E731
                attempt("gmm bwd", shape, f"plait {be}", bwd, flops=2 * fl)
            attempt("gmm fwd", shape, "dense mm same FLOPs", lambda: lambda: a @ b, flops=fl)
    finally:
        torch.set_float32_matmul_precision(before)


def table(copy_gbs: float, mm_tfs: float) -> str:
    lines = [
        "| id | kernel | shape | impl | ms | GB/s or TFLOP/s | % of ceiling | peak extra GiB | note |",
        "|---|---|---|---|---:|---:|---:|---:|---|",
    ]
    for r in ROWS:
        labels = (
            f"| `{row_id(r['kernel'], r['shape'], r['impl'])}` | {r['kernel']} | {r['shape']} | {r['impl']}"
        )
        if r["ms"] is None:
            lines.append(f"{labels} | - | - | - | - | {r['note']} |")
            continue
        if r["flops"]:
            rate = r["flops"] / r["ms"] / 1e9
            rate_s, frac = f"{rate:.0f} TFLOP/s", rate / mm_tfs
        else:
            rate = r["bytes"] / r["ms"] / 1e6
            rate_s, frac = f"{rate:.0f} GB/s", rate / copy_gbs
        mem = f"{r['mem']:.2f}" if r["mem"] is not None else ""
        lines.append(f"{labels} | {r['ms']:.3f} | {rate_s} | {100 * frac:.0f}% | {mem} | {r['note']} |")
    return "\n".join(lines)


def run_once(sel: set[str], quick: bool) -> None:
    """Measure the selected kernels once, appending to ``ROWS``."""
    for name, fn in (
        ("gmm", bench_gmm),
        ("lce", bench_lce),
        ("swiglu", bench_swiglu),
        ("rms_norm", bench_rms_norm),
        ("adamw", bench_adamw),
        ("permute", bench_permute),
    ):
        if name in sel:
            try:
                fn(quick)
            except Exception as e:
                add(name, "-", "-", None, note=f"benchmark failed: {type(e).__name__}: {str(e)[:100]}")
            gc.collect()
            torch.cuda.empty_cache()
            print(f"[done {name}]", file=sys.stderr, flush=True)


def check(sel: set[str], quick: bool) -> int:
    """Run the rows ``CHECK_RUNS`` times and compare each row's median ms with the committed table.

    ``ROWS`` is left holding the last run's rows with each ``ms`` replaced by the median (the table
    ``--md`` writes).
    """
    text = RESULTS.read_text()
    committed = parse_table(text, "ms")
    if warning := device_mismatch(text, torch.cuda.get_device_name()):
        print(warning, flush=True)
    runs = []
    for _ in range(CHECK_RUNS):
        ROWS.clear()
        run_once(sel, quick)
        runs.append(
            {row_id(r["kernel"], r["shape"], r["impl"]): r["ms"] for r in ROWS if r["ms"] is not None}
        )
    measured = median_rows(runs)
    for r in ROWS:
        r["ms"] = measured.get(row_id(r["kernel"], r["shape"], r["impl"]), r["ms"])
    missing = [rid for rid in measured if rid not in committed]
    if missing:
        print(f"check: {len(missing)} rows are not in {RESULTS.name} (not compared): {missing}")
    compared = sum(rid in committed for rid in measured)
    return report(regressions(committed, measured, higher_is_better=False), compared, RESULTS.name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller shapes")
    ap.add_argument("--md", default=None, help="also write the markdown table here")
    ap.add_argument("--only", default="", help="comma list: swiglu,rms_norm,adamw,permute,lce,gmm")
    ap.add_argument(
        "--check",
        action="store_true",
        help=f"run {CHECK_RUNS} times, exit 1 naming rows > 5%% slower than results/kernels.md",
    )
    ap.add_argument(
        "--timing",
        choices=("device", "launch"),
        default="device",
        help="device: GPU time of each call, host dispatch excluded (default); launch: "
        "triton.testing.do_bench, which also counts host time the L2 flush does not hide",
    )
    args = ap.parse_args()
    global TIMING
    TIMING = args.timing
    torch.manual_seed(0)
    sel = set(filter(None, args.only.split(","))) or {"swiglu", "rms_norm", "adamw", "permute", "lce", "gmm"}
    copy_gbs, mm_tfs = ceilings()
    status = 0
    if args.check:
        status = check(sel, args.quick)  # leaves the medians in ROWS
    else:
        run_once(sel, args.quick)
    header = (
        f"device: {torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__} | "
        f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC\n"
        f"measured ceilings: copy {copy_gbs:.0f} GB/s (read+write), bf16 matmul 8192^3 {mm_tfs:.0f} TFLOP/s\n"
        f"command: python3 -m benchmarks.kernels.run_all {' '.join(sys.argv[1:])}\n"
        f"timing: {args.timing} (median{f' of {CHECK_RUNS} runs' if args.check else ''}; L2 flushed before each call"
        f"{'; host dispatch excluded' if args.timing == 'device' else ''})\n"
    )
    out = header + "\n" + table(copy_gbs, mm_tfs)
    print(out)
    if args.md:
        with open(args.md, "w") as fh:
            fh.write(out + "\n")
    sys.exit(status)


if __name__ == "__main__":
    main()
