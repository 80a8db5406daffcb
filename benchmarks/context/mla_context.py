"""Context parallelism of multi-head latent attention: the all-gather of the latent vs of the expanded K/V.

Run on two GPUs (one command):

    torchrun --standalone --nproc-per-node 2 -m benchmarks.context.mla_context \
        [--shape 16b|671b] [--seq 32768] [--markdown benchmarks/results/mla_context.md]

    torchrun --standalone --nproc-per-node 2 -m benchmarks.context.mla_context --cpu-smoke   # CPU, gloo

One DeepSeek-V3 decoder layer (the first, dense, layer; bf16 on GPU) of the 16B shapes
(``benchmarks/training/workloads.py``'s ``deepseek_v3_16b``: 16 heads, kv_lora_rank 512, q/k head 128 +
64 rope, v head 128) or of DeepSeek-V3 671B (128 heads, q_lora_rank 1536, same latent and head sizes),
one sequence of ``--seq`` tokens in the load-balanced layout over the context ranks, plain causal rows.
Forward + backward in three ways: the all-gather mode moving the latent (``context_gather="latent"``, the
default: ``kv_a_layernorm(c_kv)`` and the roped rope key, then ``kv_b_proj`` on every rank), the
all-gather mode moving the expanded K/V (``context_gather="expanded"``) and the ring (expanded K/V).

Every collective the attention issues on the context group is counted by the bytes this rank sends:
``(n - 1) x`` its shard for an all-gather, ``(n - 1) x`` its output for a reduce-scatter, each ring
send. Printed per token and layer (the bytes divided by ``(n - 1) x`` local tokens, i.e. what each
token's data costs per peer): the forward, forward + backward, and the formula of the forward
(latent: ``(kv_lora_rank + qk_rope_head_dim) x dtype bytes``; expanded: ``2 x heads x
max(qk_head_dim, v_head_dim) x dtype bytes``, since v is zero-padded to q/k's head size to share one
buffer, vs ``heads x (qk_head_dim + v_head_dim)`` unpadded); then ms per forward + backward and the speed
against the expanded all-gather. ``--cpu-smoke`` runs tiny shapes on CPU (gloo, fp32) to check the script.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from plait.models.common.attention import AttentionKernels, ContextParallel
from plait.models.common.rope import RotaryEmbedding
from plait.models.deepseek_v3 import MultiHeadLatentAttention, deepseek_v3_layer
from plait.models.deepseek_v3.hf import config_from_hf

from benchmarks.moe._common import cuda_time_ms, environment, markdown_table
from benchmarks.training.workloads import DEEPSEEK_V3_16B

SHAPES: dict[str, dict[str, Any]] = {
    "16b": {**DEEPSEEK_V3_16B, "num_hidden_layers": 1},
    "671b": {  # DeepSeek-V3's config.json, one layer (dense: first_k_dense_replace = 3 there)
        **DEEPSEEK_V3_16B, "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
        "num_hidden_layers": 1, "num_attention_heads": 128, "num_key_value_heads": 128, "q_lora_rank": 1536,
        "moe_intermediate_size": 2048, "n_routed_experts": 256, "num_experts_per_tok": 8, "n_group": 8,
        "topk_group": 4,
    },
    "smoke": {
        **DEEPSEEK_V3_16B, "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 1,
        "topk_group": 1,
    },
}  # fmt: skip
MODES = (("allgather", "latent"), ("allgather", "expanded"), ("ring", "expanded"))


class _Counter:
    """Counts the bytes this rank sends in the attention's collectives on ``group`` while active."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group, self.n, self.sent = group, dist.get_world_size(group), 0
        self._saved: dict[str, Callable[..., Any]] = {}

    def __enter__(self) -> _Counter:
        def all_gather(out: torch.Tensor, x: torch.Tensor, group: Any = None, **kw: Any) -> Any:
            if group is self.group:
                self.sent += (self.n - 1) * x.nbytes
            return self._saved["all_gather_into_tensor"](out, x, group=group, **kw)

        def reduce_scatter(out: torch.Tensor, x: torch.Tensor, *a: Any, group: Any = None, **kw: Any) -> Any:
            if group is self.group:
                self.sent += (self.n - 1) * out.nbytes
            return self._saved["reduce_scatter_tensor"](out, x, *a, group=group, **kw)

        def batch_isend_irecv(ops: list[Any]) -> Any:
            self.sent += sum(op.tensor.nbytes for op in ops if op.op is dist.isend and op.group is self.group)
            return self._saved["batch_isend_irecv"](ops)

        for name, fn in (
            ("all_gather_into_tensor", all_gather),
            ("reduce_scatter_tensor", reduce_scatter),
            ("batch_isend_irecv", batch_isend_irecv),
        ):
            self._saved[name] = getattr(dist, name)
            setattr(dist, name, fn)
        return self

    def __exit__(self, *exc: object) -> None:
        for name, fn in self._saved.items():
            setattr(dist, name, fn)


def _formula(cfg: Any, gather: str, nbytes: int) -> int:
    if gather == "latent":
        return (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * nbytes
    return 2 * cfg.num_attention_heads * max(cfg.qk_head_dim, cfg.v_head_dim) * nbytes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=("16b", "671b"), default="16b")
    p.add_argument("--seq", type=int, default=32768, help="tokens of the sequence (all ranks together)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--markdown", help="write the table to this file")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on CPU + gloo: checks the script")
    args = p.parse_args()
    cuda = torch.cuda.is_available() and not args.cpu_smoke
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    shape = "smoke" if args.cpu_smoke else args.shape
    seq = 64 if args.cpu_smoke else args.seq
    iters, warmup = (2, 1) if args.cpu_smoke else (args.iters, args.warmup)
    cfg = config_from_hf({**SHAPES[shape], "max_position_embeddings": seq, "attn_implementation": "sdpa"})
    group = dist.group.WORLD
    n, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    with torch.device(device):
        layer = deepseek_v3_layer(cfg, 0).to(dtype)
        rotary = RotaryEmbedding(cfg.rope_parameters, cfg.rope_head_dim, cfg.max_position_embeddings)
    layer.reset_parameters(cfg.initializer_range)
    attn = layer.self_attn
    assert isinstance(attn, MultiHeadLatentAttention)
    local = seq // n
    x = torch.randn(1, local, cfg.hidden_size, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn_like(x)
    nbytes = torch.empty((), dtype=dtype).element_size()
    rows, outputs = [], {}
    expanded_ms: float | None = None
    for mode, gather in MODES:
        cp = ContextParallel(group, mode)
        mask = cp.build_mask(1, local, device, dtype=dtype, kernels=AttentionKernels())
        rope = rotary(cp.local_positions(local, device)[None], dtype)
        attn.context_gather = gather

        def step(layer: Any = layer, rope: Any = rope, mask: Any = mask) -> None:
            layer(x, rope, mask)[0].backward(grad)

        with _Counter(group) as fwd:
            out = layer(x, rope, mask)[0]
        with _Counter(group) as both:
            layer(x, rope, mask)[0].backward(grad)
        outputs[(mode, gather)] = out.detach().float()
        layer.zero_grad(set_to_none=True)
        ms = cuda_time_ms(step, warmup, iters)
        if (mode, gather) == ("allgather", "expanded"):
            expanded_ms = ms
        per_token = (n - 1) * local
        rows.append([f"{mode} ({gather})", f"{_formula(cfg, gather, nbytes)}", f"{fwd.sent // per_token}",
                     f"{both.sent // per_token}", f"{ms:.2f}", ms])  # fmt: skip
    for row in rows:
        ms = row.pop()
        row.append(f"{expanded_ms / ms:.2f}x" if expanded_ms else "-")
    ref = outputs[("allgather", "expanded")]
    for key, out in outputs.items():  # the three ways compute the same layer
        torch.testing.assert_close(
            out, ref, atol=2e-2 if cuda else 1e-5, rtol=2e-2 if cuda else 1e-5, msg=str(key)
        )
    if rank == 0:
        env = environment()
        title = (
            f"MLA context parallelism, one {shape} DeepSeek-V3 layer, cp={n}, {seq} tokens, {dtype}; "
            f"{env['device']}, torch {env['torch']}, {env['date']}"
        )
        header = ["mode (moves)", "formula B/token fwd", "counted B/token fwd", "counted B/token fwd+bwd",
                  "ms fwd+bwd", "vs expanded all-gather"]  # fmt: skip
        text = f"{title}\n\n{markdown_table(header, rows)}\n"
        print(text)
        if args.markdown:
            cmd = (
                "torchrun --standalone --nproc-per-node "
                + f"{n} -m benchmarks.context.mla_context "
                + " ".join(sys.argv[1:])
            )
            Path(args.markdown).write_text(
                f"# {title}\n\nCommand: `{cmd}`\n\n{markdown_table(header, rows)}\n"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
