"""Context parallelism (gloo, CPU) equals the single-process float64 computation.

Attention: every rank holds its load-balanced shard of q/k/v; the output and the gradients of q, k
and v (for an upstream gradient sharded the same way) are compared with plain SDPA over the full
sequence. Model: a small Qwen3-MoE with cp=2 (the parallel plan applied from a DistributedContext,
FSDP over ``dp_cp_shard``) gives the loss and the gradients of the 1-process model.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
from plait.dist_core import (
    DeviceMeshParameters,
    DistributedContext,
    gather_sequence,
    shard_batch,
    shard_sequence,
)
from plait.dist_core.testing import run_distributed
from plait.models import (
    ActivationCheckpointing,
    AttentionMask,
    ParallelConfig,
    build_attention_mask,
    load_hf_checkpoint,
    parallelize,
    save_hf_checkpoint,
)
from plait.models.common import attention as attention_mod
from plait.models.common.attention.context import ring as ring_mod
from plait.models.qwen3 import Qwen3ForCausalLM, Qwen3ForSequenceClassification, Qwen3MoeConfig
from plait.moe import RouterConfig, TopKRouter
from torch.distributed.tensor import DTensor

from ._families import SMALL

B, T, HQ, HKV, D = 2, 24, 4, 2, 16  # FlexAttention on CUDA (Inductor) needs head dims >= 16
# Document lengths per row: several cross chunk (and rank) boundaries for cp = 2 and 4.
DOC_LENGTHS = ([5, 9, 3, 7], [11, 13])


def _doc_ids() -> torch.Tensor:
    rows = [torch.repeat_interleave(torch.arange(len(ls)), torch.tensor(ls)) for ls in DOC_LENGTHS]
    return torch.stack(rows)


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "q": torch.randn(B, T, HQ, D, generator=g, dtype=torch.float64),
        "k": torch.randn(B, T, HKV, D, generator=g, dtype=torch.float64),
        "v": torch.randn(B, T, HKV, D, generator=g, dtype=torch.float64),
        "grad": torch.randn(B, T, HQ, D, generator=g, dtype=torch.float64),
    }


def _sinks() -> torch.Tensor:
    return torch.randn(HQ, generator=torch.Generator().manual_seed(5), dtype=torch.float64)


def _reference(docs: bool, window: int | None = None, sinks: bool = False) -> dict[str, torch.Tensor]:
    t = {k: v.clone().requires_grad_(k != "grad") for k, v in _tensors().items()}
    mask = build_attention_mask(
        B,
        T,
        torch.device("cpu"),
        torch.float64,
        document_ids=_doc_ids() if docs else None,
        implementation="sdpa",
        sliding_window=window,
        sinks=sinks,
    )
    sink = _sinks().requires_grad_() if sinks else None
    out = attention_mod.attention(t["q"], t["k"], t["v"], mask, D**-0.5, sink)
    out.backward(t["grad"])
    res = {"out": out.detach(), "dq": t["q"].grad, "dk": t["k"].grad, "dv": t["v"].grad}
    if sink is not None:
        res["dsinks"] = sink.grad
    return res


def _attention_rank(
    mode: str,
    docs: bool,
    tile: int,
    device: str = "cpu",
    dtype: torch.dtype = torch.float64,
    impl: str | None = None,
    window: int | None = None,
    sinks: bool = False,
) -> dict[str, torch.Tensor]:
    ring_mod._Q_TILE = tile
    n, r = dist.get_world_size(), dist.get_rank()
    dev = torch.device(device, torch.cuda.current_device()) if device == "cuda" else torch.device(device)
    cp = attention_mod.ContextParallel(dist.group.WORLD, mode)  # type: ignore[arg-type]
    # Default: SDPA on CPU; on CUDA "auto" is FlexAttention for the all-gather mode.
    impl = impl or ("sdpa" if device == "cpu" else "auto")
    forward_only = impl == "flex" and device == "cpu"  # FlexAttention has no backward on CPU
    local = {
        k: shard_sequence(v, n, r).to(dev, dtype).requires_grad_(k != "grad" and not forward_only)
        for k, v in _tensors().items()
    }
    doc_ids = shard_sequence(_doc_ids(), n, r).to(dev) if docs else None
    mask = cp.build_mask(
        B,
        T // n,
        dev,
        document_ids=doc_ids,
        implementation=impl,
        dtype=dtype,
        sliding_window=window,
        sinks=sinks,
    )
    assert isinstance(mask, AttentionMask) and mask.context is not None
    sink = _sinks().to(dev, dtype).requires_grad_(not forward_only) if sinks else None
    group = dist.group.WORLD
    if forward_only:
        out = attention_mod.attention(local["q"], local["k"], local["v"], mask, D**-0.5, sink)
        return {"out": gather_sequence(out, group).double()}  # type: ignore[arg-type]
    gathers = []  # K/V all-gathers: the forward's, and the backward's when the attention unpacks K/V
    all_gather = dist.all_gather_into_tensor

    def counted(*args: Any, **kwargs: Any) -> Any:
        gathers.append("backward" if torch._C._current_graph_task_id() >= 0 else "forward")
        return all_gather(*args, **kwargs)

    dist.all_gather_into_tensor = counted  # type: ignore[assignment]
    try:
        out = attention_mod.attention(local["q"], local["k"], local["v"], mask, D**-0.5, sink)
        out.backward(local["grad"])
    finally:
        dist.all_gather_into_tensor = all_gather
    # all-gather: the attention keeps this rank's K/V shard, not the gathered K/V, for its backward
    # (except the PyTorch sink reference, whose saved K/V are GQA-repeated copies, not views).
    want = ["forward"] if sinks and impl == "sdpa" else ["forward", "backward"]
    assert gathers == (want if mode == "allgather" else []), gathers
    extra = {}
    if sink is not None:  # each rank's queries' share of the sinks' gradient, summed over the group
        assert sink.grad is not None
        dist.all_reduce(sink.grad, group=group)
        extra["dsinks"] = sink.grad.double()
    return {
        **extra,
        "chunk_kernels": torch.tensor(
            mode == "allgather" and mask.block_mask is None and mask.dense_mask is None
        ),
        "out": gather_sequence(out.detach(), group).double(),  # type: ignore[arg-type]
        "dq": gather_sequence(local["q"].grad, group).double(),  # type: ignore[arg-type]
        "dk": gather_sequence(local["k"].grad, group).double(),  # type: ignore[arg-type]
        "dv": gather_sequence(local["v"].grad, group).double(),  # type: ignore[arg-type]
    }


@pytest.mark.parametrize("mode", ["ring", "allgather"])
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("docs", [False, True], ids=["causal", "documents"])
def test_attention_matches_single_process(mode: str, cp: int, docs: bool) -> None:
    ref = _reference(docs)
    tile = 2 if cp == 2 else ring_mod._Q_TILE  # small query tiles exercise the ring kernel's tiling
    for rank, res in enumerate(run_distributed(_attention_rank, cp, mode, docs, tile)):
        # Plain causal rows of the all-gather mode: per-chunk SDPA kernels merged by log-sum-exp.
        assert bool(res["chunk_kernels"]) == (mode == "allgather" and not docs)
        for key, want in ref.items():
            torch.testing.assert_close(res[key], want, rtol=1e-10, atol=1e-10, msg=f"rank {rank} {key}")


@pytest.mark.parametrize("mode", ["ring", "allgather"])
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("window", [2, 7])
def test_sliding_window_and_sinks_match_single_process(mode: str, cp: int, window: int) -> None:
    # gpt-oss's attention: windows inside one chunk (2) and across chunks and ranks (7; chunks are
    # 6 tokens at cp=2, 3 at cp=4), one sink logit per query head, packed documents; the sinks'
    # gradient (through the ring's log-sum-exp or the all-gather's dense path) summed over ranks.
    ref = _reference(True, window, sinks=True)
    for rank, res in enumerate(
        run_distributed(_attention_rank, cp, mode, True, 2, window=window, sinks=True)
    ):
        assert not bool(res["chunk_kernels"])
        assert set(res) == {"chunk_kernels", *ref}
        for key, want in ref.items():
            torch.testing.assert_close(res[key], want, rtol=1e-10, atol=1e-10, msg=f"rank {rank} {key}")


@pytest.mark.parametrize("docs", [False, True], ids=["causal", "documents"])
def test_allgather_flex_forward_on_cpu(docs: bool) -> None:
    # The block mask of the all-gather mode's FlexAttention path (CUDA's default), checked on CPU.
    want = _reference(docs)["out"]
    for rank, res in enumerate(run_distributed(_attention_rank, 2, "allgather", docs, 4, impl="flex")):
        assert set(res) == {"out"}
        torch.testing.assert_close(res["out"], want, rtol=1e-10, atol=1e-10, msg=f"rank {rank}")


@pytest.mark.multigpu
@pytest.mark.parametrize("mode", ["ring", "allgather"])
@pytest.mark.parametrize(
    ("dtype", "tol"), [(torch.float32, 2e-4), (torch.bfloat16, 5e-2)], ids=["fp32", "bf16"]
)
@pytest.mark.parametrize("docs", [False, True], ids=["causal", "documents"])
def test_attention_on_two_gpus_nccl(mode: str, dtype: torch.dtype, tol: float, docs: bool) -> None:
    # bf16 runs the ring's tensor-core kernel (bf16 operands, fp32 accumulation); plain causal bf16
    # rows of the all-gather mode run cuDNN per chunk on Hopper (FlexAttention otherwise).
    ref = _reference(docs=docs)
    results = run_distributed(_attention_rank, 2, mode, docs, 4, "cuda", dtype, backend="nccl")
    hopper = torch.cuda.get_device_capability() >= (9, 0)
    for rank, res in enumerate(results):
        want_chunks = mode == "allgather" and not docs and dtype == torch.bfloat16 and hopper
        assert bool(res["chunk_kernels"]) == want_chunks
        for key, want in ref.items():
            torch.testing.assert_close(res[key], want, rtol=tol, atol=tol, msg=f"rank {rank} {key}")


def _positions_rank(mode: str) -> torch.Tensor:
    # Documents given as position ids that restart (a restart sits exactly on a rank boundary).
    n, r = dist.get_world_size(), dist.get_rank()
    cp = attention_mod.ContextParallel(dist.group.WORLD, mode)  # type: ignore[arg-type]
    pos = torch.cat([torch.arange(12), torch.arange(5), torch.arange(7)])[None]
    mask = cp.build_mask(1, T // n, torch.device("cpu"), position_ids=shard_sequence(pos, n, r))
    assert mask.context is not None and mask.context.document_ids is not None
    return mask.context.document_ids


def test_documents_from_restarting_positions() -> None:
    want = torch.repeat_interleave(torch.arange(1, 4), torch.tensor([12, 5, 7]))[None]
    for res in run_distributed(_positions_rank, 2, "ring"):
        assert torch.equal(res, want.to(res.dtype))


def test_bad_implementation() -> None:
    with pytest.raises(ValueError, match="attn_implementation='flash' is not available with context"):
        attention_mod.ContextParallel(None, "ring").build_mask(  # type: ignore[arg-type]
            1, 4, torch.device("cpu"), implementation="flash"
        )


def _plan_errors_rank() -> list[str]:
    cfg = Qwen3MoeConfig(**CFG)
    errors = []
    for degrees, cls in (({"context_replicate": 2}, Qwen3ForCausalLM), ({"context_shard": 2}, "classifier")):
        ctx = DistributedContext.from_env(DeviceMeshParameters(**degrees), device="cpu")
        with torch.device("meta"):
            model = (
                Qwen3ForCausalLM(cfg) if cls is Qwen3ForCausalLM else Qwen3ForSequenceClassification(cfg, 2)
            )
        try:
            parallelize(model, context=ctx)
        except ValueError as e:
            errors.append(str(e))
        ctx.shutdown()
    return errors


def test_plan_refuses_unsupported_context_layouts() -> None:
    for errors in run_distributed(_plan_errors_rank, 2):
        assert len(errors) == 2
        assert "context_replicate > 1 is not supported with data_parallel='fsdp'" in errors[0]
        assert (
            "context parallelism supports causal-LM stages, not Qwen3ForSequenceClassification" in errors[1]
        )


# --------------------------------------------------------------------------------- MoE balancing
def _router() -> TopKRouter:
    cfg = RouterConfig(top_k=2, aux_loss_coef=0.1, seq_aux_loss_coef=0.3, z_loss_coef=0.01)
    torch.manual_seed(1)
    return TopKRouter(8, 4, cfg).double()


def _router_tokens() -> torch.Tensor:
    return torch.randn(2, 12, 8, generator=torch.Generator().manual_seed(2), dtype=torch.float64)


def _router_mask(masked: bool) -> torch.Tensor | None:
    """``[2, 12]`` token mask (False = padding) or None."""
    if not masked:
        return None
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[0, :5] = False
    mask[1, 10:] = False
    return mask


def _router_rank(masked: bool) -> dict[str, torch.Tensor]:
    n, r = dist.get_world_size(), dist.get_rank()
    router = _router()
    router.context_group = dist.group.WORLD
    x = shard_sequence(_router_tokens(), n, r).requires_grad_()
    mask = _router_mask(masked)
    token_mask = None if mask is None else shard_sequence(mask, n, r).reshape(-1)
    out = router(x.reshape(-1, 8), num_sequences=2, token_mask=token_mask)
    assert out.switch_stats is not None
    # Each rank holds its share of the real tokens: the loop's aux * n_r / N.
    share = (x.shape[1] * 2 if token_mask is None else int(token_mask.sum())) / (
        24 if mask is None else int(mask.sum())
    )
    (out.aux_loss * share).backward()
    grad = router.weight.grad
    assert grad is not None
    dist.all_reduce(grad)  # what FSDP's sum over the context ranks does
    losses = torch.stack([out.aux_loss.detach(), *(out.losses[k] for k in ("switch", "seq", "z"))])
    return {
        "losses": losses,
        "stats": out.switch_stats.detach(),
        "weight_grad": grad,
        "x_grad": gather_sequence(x.grad, None),  # type: ignore[arg-type]
    }


@pytest.mark.parametrize("masked", [False, True], ids=["all_tokens", "padding"])
def test_balancing_losses_over_context_group(masked: bool) -> None:
    router = _router()
    x = _router_tokens().requires_grad_()
    mask = _router_mask(masked)
    out = router(x.reshape(-1, 8), num_sequences=2, token_mask=None if mask is None else mask.reshape(-1))
    out.aux_loss.backward()
    assert out.switch_stats is not None
    want = torch.stack([out.aux_loss.detach(), *(out.losses[k] for k in ("switch", "seq", "z"))])
    # The router computes its scores and losses in float32 (sums in another order here).
    for res in run_distributed(_router_rank, 3, masked):
        torch.testing.assert_close(res["losses"], want, rtol=1e-6, atol=0)
        torch.testing.assert_close(res["stats"], out.switch_stats.detach(), rtol=1e-6, atol=1e-12)
        torch.testing.assert_close(res["weight_grad"], router.weight.grad, rtol=1e-5, atol=1e-9)
        torch.testing.assert_close(res["x_grad"], x.grad, rtol=1e-5, atol=1e-9)


# ---------------------------------------------------------------------------------------------- model
CFG = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,  # FlexAttention on CUDA (Inductor) needs head dims >= 16
    num_experts=4,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    mlp_only_layers=(1,),
    router_aux_loss_coef=0.02,
    initializer_range=0.2,
)
SEQ = 16


def _cp_model(family: str, pooling: str, **kw: Any) -> Any:
    """A causal LM (or stage, ``kw``) of ``family`` for these tests; ``attn_implementation`` etc. in ``kw``."""
    cfg_kw = {k: kw.pop(k) for k in list(kw) if k == "attn_implementation"}
    if family == "qwen3_moe":
        return Qwen3ForCausalLM(Qwen3MoeConfig(**CFG, router_aux_loss_pooling=pooling, **cfg_kw), **kw)
    cls, cfg_cls, kwargs = SMALL[family]
    kwargs = {**kwargs, "vocab_size": 96, "head_dim": 16, **cfg_kw}
    if family == "gpt_oss":  # sliding window 3 < a 4-token chunk: some chunk pairs see nothing
        kwargs.update(router_aux_loss_coef=0.02, router_aux_loss_pooling=pooling)
    return cls(cfg_cls(**kwargs), **kw)


def _model_batch(packed: bool, padded: bool = False) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    batch = {
        "input_ids": torch.randint(0, 96, (2, SEQ), generator=g),
        "labels": torch.randint(0, 96, (2, SEQ), generator=g),
    }
    batch["labels"][0, :3] = -100
    batch["labels"][1, 9:11] = -100
    if packed:
        # Position ids restarting per document; documents cross the chunk and rank boundaries.
        batch["position_ids"] = torch.cat([torch.arange(6), torch.arange(7), torch.arange(3)]).expand(2, SEQ)
    if padded:
        # transformers' padding mask: row 0 left-padded (5 tokens, across the first chunk boundary),
        # row 1 right-padded (3 tokens, on the last rank's chunk for cp=2).
        mask = torch.ones(2, SEQ, dtype=torch.long)
        mask[0, :5] = 0
        mask[1, -3:] = 0
        batch["attention_mask"] = mask
    return batch


def _scored(batch: dict[str, torch.Tensor]) -> int:
    """Scored tokens of a batch: labels not ignored, outside the padding."""
    scored = batch["labels"] != -100
    if "attention_mask" in batch:
        scored &= batch["attention_mask"] != 0
    return int(scored.sum())


def _objective(out: dict[str, torch.Tensor], batch: dict[str, torch.Tensor]) -> torch.Tensor:
    # The loop's objective of one microbatch: token-summed loss plus aux loss weighted by tokens.
    assert int(out["num_tokens"]) == _scored(batch)
    if "aux_loss" not in out:  # dense models
        return out["loss_sum"]
    return out["loss_sum"] + out["aux_loss"] * _scored(batch)


def _stages_forward(parts: list[Qwen3ForCausalLM], batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Run the stages one after the other (a pipeline without the pipeline), stage kwargs like the loop's."""
    out: dict[str, torch.Tensor] = {}
    for i, part in enumerate(parts):
        kw = {k: v for k, v in batch.items() if k in ("position_ids", "document_ids", "attention_mask")}
        if i == 0:
            kw["input_ids"] = batch["input_ids"]
        else:
            kw.update(out)  # hidden_states, aux_loss and (pooled Switch loss) router_stats
        if i == len(parts) - 1:
            kw["labels"] = batch["labels"]
        out = part(**kw)
    return out


def _model_rank(
    mode: str,
    packed: bool,
    padded: bool,
    pooling: str,
    ckpt: str,
    degrees: dict[str, int],
    stages: int,
    device: str = "cpu",
    checkpointing: str = "none",
    compile: bool = False,
    family: str = "qwen3_moe",
) -> dict:
    torch.set_default_dtype(torch.float64)  # the harness restores it (and the environment)
    # The float64 comparison is about context parallelism over NCCL, not the fp32 Triton kernels.
    os.environ["PLAIT_KERNELS_DISABLE_TRITON"] = "1"
    ctx = DistributedContext.from_env(DeviceMeshParameters(**degrees), device=device)
    with torch.device("meta"):
        parts = [
            _cp_model(family, pooling, attn_implementation="sdpa", stage_index=i, num_stages=stages)
            for i in range(stages)
        ]
    for part in parts:
        config = ParallelConfig(
            context_parallel_attention=mode,
            activation_checkpointing=ActivationCheckpointing(mode=checkpointing),
            compile=compile,
        )
        parallelize(part, context=ctx, config=config)
        part.to_empty(device=ctx.device)
        part.reset_parameters()
    load_hf_checkpoint(parts, ckpt)
    from torch.distributed.fsdp import FSDPModule

    for m in (m for part in parts for m in part.modules()):
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)  # sum, like plait.loop
            m.set_force_sum_reduction_for_comms(True)
    batch_mesh = ctx.mesh_for("batch")
    dp, dp_rank = batch_mesh["dp"].size(), batch_mesh["dp"].get_local_rank()
    cp_mesh = batch_mesh["cp"]
    full = _model_batch(packed, padded)
    rows = {k: v[dp_rank * 2 // dp : (dp_rank + 1) * 2 // dp] for k, v in full.items()}
    batch = shard_batch(
        {k: v.to(ctx.device) for k, v in rows.items()}, cp_mesh.size(), cp_mesh.get_local_rank()
    )
    out = _stages_forward(parts, batch)
    global_tokens = _scored(full)
    (_objective(out, batch) / global_tokens).backward()
    loss_sum = out["loss_sum"].detach().clone()
    dist.all_reduce(loss_sum)
    loss_sum /= ctx.params.tensor  # tensor-parallel ranks hold the same tokens
    grads = {
        n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).cpu()
        for part in parts
        for n, p in part.named_parameters()
    }
    aux = out["aux_loss"].detach().clone() if "aux_loss" in out else torch.zeros((), device=ctx.device)
    if dp > 1:  # per-sequence-group aux losses, token-weighted over dp like the loop's metric
        aux *= _scored(batch)
        dist.all_reduce(aux, group=batch_mesh["dp"].get_group())
        dist.all_reduce(aux, group=cp_mesh.get_group())
        aux /= global_tokens
    return {"loss": loss_sum.item() / global_tokens, "aux": aux.item(), "grads": grads}


# layout -> (degrees, attention mode, packed documents, padded (attention_mask), MoE aux-loss
# pooling, pipeline stages run one after the other)
LAYOUTS = {
    "cp2_ring": ({"context_shard": 2}, "ring", False, False, "all_layers", 1),
    "cp2_ring_packed_per_layer": ({"context_shard": 2}, "ring", True, False, "per_layer", 1),
    "cp2_ring_padded": ({"context_shard": 2}, "ring", False, True, "all_layers", 1),
    "cp2_allgather": ({"context_shard": 2}, "allgather", False, False, "per_layer", 1),
    "cp2_allgather_packed": ({"context_shard": 2}, "allgather", True, False, "all_layers", 1),
    "cp2_allgather_packed_padded": ({"context_shard": 2}, "allgather", True, True, "per_layer", 1),
    "cp2_2stages_allgather_packed": ({"context_shard": 2}, "allgather", True, False, "all_layers", 2),
    "cp2_2stages_ring_padded_per_layer": ({"context_shard": 2}, "ring", False, True, "per_layer", 2),
    "dp2_cp2_ep2_ring_packed": (
        {"data_shard": 2, "context_shard": 2, "expert": 2},
        "ring",
        True,
        False,
        "all_layers",
        1,
    ),
    "cp2_tp2_allgather_packed": ({"context_shard": 2, "tensor": 2}, "allgather", True, False, "per_layer", 1),
    "cp2_tp2_ring_packed": ({"context_shard": 2, "tensor": 2}, "ring", True, False, "all_layers", 1),
    # activation checkpointing around the collectives (the all-gather mode's saved-tensor hooks included)
    "cp2_allgather_packed_full_ac": ({"context_shard": 2}, "allgather", True, False, "all_layers", 1),
    "cp2_ring_padded_selective_ac": ({"context_shard": 2}, "ring", False, True, "per_layer", 1),
    "cp2_allgather_full_ac": (
        {"context_shard": 2},
        "allgather",
        False,
        False,
        "per_layer",
        1,
    ),  # per-chunk kernels
    # compiled decoder layers (the all-gather attention runs eagerly between their graphs)
    "cp2_allgather_compiled": ({"context_shard": 2}, "allgather", False, False, "all_layers", 1),
}
CHECKPOINTING = {
    "cp2_allgather_packed_full_ac": "full",
    "cp2_ring_padded_selective_ac": "selective",
    "cp2_allgather_full_ac": "full",
}
COMPILED = {"cp2_allgather_compiled"}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_moe_model_with_context_parallel_matches_single_process(layout: str, tmp_path) -> None:
    check_model_layout(layout, tmp_path, "cpu")


@pytest.mark.multigpu
@pytest.mark.parametrize(
    "layout", ["cp2_ring_packed_per_layer", "cp2_allgather_packed_padded", "cp2_allgather_packed_full_ac"]
)
def test_moe_model_with_context_parallel_on_two_gpus_nccl(layout: str, tmp_path) -> None:
    check_model_layout(layout, tmp_path, "cuda")


# Llama (dense) and gpt-oss (sliding window, sinks, experts) in both modes, with and without packed
# documents; gpt-oss also with padding, TP and two stages.
FAMILY_LAYOUTS = [
    (family, layout)
    for family in sorted(SMALL)
    for layout in ("cp2_ring", "cp2_ring_packed_per_layer", "cp2_allgather", "cp2_allgather_packed")
] + [
    ("gpt_oss", "cp2_ring_padded"),
    ("gpt_oss", "cp2_allgather_packed_padded"),
    # sinks sharded by head under TP, each rank's heads' log-sum-exp (ring) or dense path (all-gather)
    ("gpt_oss", "cp2_tp2_ring_packed"),
    ("gpt_oss", "cp2_tp2_allgather_packed"),
    # stages with other sets of windows (layers 0-1: window and full; layer 2: window)
    ("gpt_oss", "cp2_2stages_ring_padded_per_layer"),
    ("llama", "cp2_tp2_ring_packed"),
]


@pytest.mark.parametrize(("family", "layout"), FAMILY_LAYOUTS)
def test_family_model_with_context_parallel_matches_single_process(
    family: str, layout: str, tmp_path
) -> None:
    check_model_layout(layout, tmp_path, "cpu", family)


def check_model_layout(layout: str, tmp_path, device: str, family: str = "qwen3_moe") -> None:
    degrees, mode, packed, padded, pooling, stages = LAYOUTS[layout]
    torch.manual_seed(0)
    model = _cp_model(family, pooling)
    model.reset_parameters()
    model.double()
    ckpt = save_hf_checkpoint(model, tmp_path / "seed")
    batch = _model_batch(packed, padded)
    tokens = _scored(batch)
    if "data_shard" in degrees:  # one row per data-parallel rank: the aux loss is per row
        rows = [{k: v[i : i + 1] for k, v in batch.items()} for i in range(2)]
        outs = [model(**row) for row in rows]
        objective = sum(_objective(o, row) for o, row in zip(outs, rows, strict=True))
        ref_loss = float(sum(o["loss_sum"].detach() for o in outs)) / tokens
        ref_aux = (
            float(sum(o["aux_loss"].detach() * _scored(row) for o, row in zip(outs, rows, strict=True)))
            / tokens
        )
    else:
        out = model(**batch)
        objective = _objective(out, batch)
        ref_loss, ref_aux = out["loss"].item(), out["aux_loss"].item() if "aux_loss" in out else 0.0
    (objective / tokens).backward()
    ref_grads = {n: p.grad for n, p in model.named_parameters()}
    world = 1
    for d in degrees.values():
        world *= d
    world //= degrees.get("expert", 1)
    backend = "nccl" if device == "cuda" else "gloo"
    results = run_distributed(
        _model_rank,
        world,
        mode,
        packed,
        padded,
        pooling,
        str(ckpt),
        degrees,
        stages,
        device,
        CHECKPOINTING.get(layout, "none"),
        layout in COMPILED,
        family,
        backend=backend,
        timeout=300.0,
    )
    for rank, res in enumerate(results):
        # The fused cross-entropy kernel and the router work in float32: fp32 tolerances.
        assert res["loss"] == pytest.approx(ref_loss, rel=1e-6), rank
        assert res["aux"] == pytest.approx(ref_aux, rel=1e-6), rank
        assert set(res["grads"]) == set(ref_grads)
        for name, want in ref_grads.items():
            torch.testing.assert_close(
                res["grads"][name], want, rtol=1e-5, atol=1e-7, msg=f"rank {rank} {name}"
            )


def test_private_aten_attention_ops_keep_the_arguments_passed_positionally():
    """The private SDPA ops the context-parallel chunk kernels call positionally
    (``common/attention/context/_aten.py``): a torch upgrade that renames, reorders or drops one of
    their leading arguments fails here."""
    from plait.models.common.attention.context._aten import FORWARD_OPS

    for op, names in FORWARD_OPS.items():
        packet = getattr(torch.ops.aten, op, None)
        assert packet is not None, f"torch.ops.aten.{op} is gone (torch {torch.__version__})"
        args = [a.name for a in packet.default._schema.arguments]
        assert args[: len(names)] == list(names), f"aten.{op}: schema now {args}"
