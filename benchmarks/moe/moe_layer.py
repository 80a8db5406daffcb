"""Forward+backward throughput of one MoE layer, plait vs Hugging Face Qwen3-MoE, on one GPU.

Default shapes are Qwen3-30B-A3B's: hidden 2048, 128 experts, top-8, expert FFN 768, 16k tokens,
bf16. The HF baseline is ``Qwen3MoeSparseMoeBlock`` with its ``grouped_mm`` experts implementation
(transformers 5.x); with transformers 4.x (no experts implementations) the baseline is its eager
per-expert loop, and the table says so. Both layers hold the same weights; outputs are compared.

    python -m benchmarks.moe.moe_layer [--tokens 16384] [--markdown benchmarks/results/moe_layer.md]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from plait.moe import MoELayer, RouterConfig

from benchmarks.moe._common import (
    bf16_matmul_tflops,
    cuda_time_ms,
    environment,
    layer_flops,
    markdown_table,
    timing_rows,
)


def build_hf(args: argparse.Namespace) -> tuple[torch.nn.Module | None, str]:
    """HF sparse block (grouped_mm experts where available) and a label, or (None, reason)."""
    try:
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    except ImportError as e:
        return None, f"transformers Qwen3-MoE unavailable ({e})"
    cfg = Qwen3MoeConfig(
        hidden_size=args.hidden,
        moe_intermediate_size=args.ffn,
        num_experts=args.experts,
        num_experts_per_tok=args.topk,
        norm_topk_prob=True,
    )
    label = "HF Qwen3MoeSparseMoeBlock (eager loop; this transformers has no experts implementations)"
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

        if "grouped_mm" in ALL_EXPERTS_FUNCTIONS:
            cfg._experts_implementation = "grouped_mm"
            label = "HF Qwen3MoeSparseMoeBlock (grouped_mm experts)"
    except ImportError:
        pass
    block = Qwen3MoeSparseMoeBlock(cfg)
    return block, label


def copy_hf_into_plait(hf: torch.nn.Module, ours: MoELayer) -> None:
    """Same weights in both: HF 5.x stacks experts like plait; 4.x has per-expert nn.Linear's."""
    with torch.no_grad():
        if hasattr(hf.experts, "gate_up_proj"):
            hf.experts.gate_up_proj.copy_(ours.experts.gate_up_proj)
            hf.experts.down_proj.copy_(ours.experts.down_proj)
        else:  # transformers 4.x
            inter = ours.experts.intermediate_size
            for e, mlp in enumerate(hf.experts):
                mlp.gate_proj.weight.copy_(ours.experts.gate_up_proj[e, :inter])
                mlp.up_proj.weight.copy_(ours.experts.gate_up_proj[e, inter:])
                mlp.down_proj.weight.copy_(ours.experts.down_proj[e])
        hf.gate.weight.copy_(ours.router.weight)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--ffn", type=int, default=768)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--markdown", type=Path, default=None, help="write the results table here")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (fp32): checks the script runs")
    args = p.parse_args()
    if args.smoke:
        args.tokens, args.hidden, args.experts, args.topk, args.ffn, args.warmup, args.iters = (
            64,
            32,
            8,
            2,
            16,
            1,
            2,
        )
    elif not torch.cuda.is_available():
        raise SystemExit("moe_layer.py needs a CUDA GPU (or --smoke)")
    torch.manual_seed(0)
    dev = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16

    ours = MoELayer(args.hidden, args.ffn, args.experts, RouterConfig(top_k=args.topk, norm_topk_prob=True))
    ours.to(dev, dtype)
    hf, hf_label = build_hf(args)
    if hf is not None:
        hf.to(dev, dtype)
        copy_hf_into_plait(hf, ours)

    x = torch.randn(1, args.tokens, args.hidden, device=dev, dtype=dtype, requires_grad=True)
    dy = torch.randn_like(x)

    def step(layer: torch.nn.Module, is_plait: bool) -> torch.Tensor:
        x.grad = None
        for q in layer.parameters():
            q.grad = None
        out = layer(x)
        y = out.hidden_states if is_plait else (out[0] if isinstance(out, tuple) else out)
        y.backward(dy)
        return y

    t, k, h, f, e = args.tokens, args.topk, args.hidden, args.ffn, args.experts
    flops = layer_flops(t, k, h, f, e)
    peak = bf16_matmul_tflops()

    results: list[tuple[str, float, float]] = []
    for name, layer, is_plait in (("plait MoELayer", ours, True), (hf_label, hf, False)):
        if layer is None:
            continue
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        ms = cuda_time_ms(
            lambda layer=layer, is_plait=is_plait: step(layer, is_plait), args.warmup, args.iters
        )
        mem = torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else float("nan")
        results.append((name, ms, mem))

    max_diff = "n/a"
    if hf is not None:
        with torch.no_grad():
            y_ours = ours(x).hidden_states.float()
            out_hf = hf(x)
            y_hf = (out_hf[0] if isinstance(out_hf, tuple) else out_hf).float()
        rel = (y_ours - y_hf).norm() / y_hf.norm()
        max_diff = f"{rel.item():.2e}"

    rows = timing_rows(results, flops, peak, t, results[1][1] if len(results) > 1 else None)
    env = environment()
    header = ["layer", "fwd+bwd ms", "Mtok/s", "TFLOP/s", "of bf16 mm peak", "vs HF", "peak mem GiB"]
    table = markdown_table(header, rows)
    text = (
        f"# MoE layer forward+backward, one GPU\n\n"
        f"{env['device']}; torch {env['torch']}, triton {env['triton']}, transformers {env['transformers']}; "
        f"{env['date']}\n\n"
        f"Shapes: {t} tokens, hidden {h}, {e} experts, top-{k}, expert FFN {f}, {str(dtype).removeprefix('torch.')}, norm_topk_prob. "
        f"Mean of {args.iters} iterations after {args.warmup} warm-up. Measured bf16 matmul peak "
        f"(8192^3 torch.mm): {peak:.0f} TFLOP/s. FLOPs counted: 3 x (6 T k H I + 2 T H E).\n"
        f"Output relative L2 difference plait vs HF (same weights): {max_diff}.\n\n{table}\n"
    )
    print(text)
    if args.markdown is not None:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(text)


if __name__ == "__main__":
    main()
