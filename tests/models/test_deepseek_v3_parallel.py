"""DeepSeek-V3 layouts on gloo against the single-process model: FSDP2 and EP=2 x FSDP2 (full
activation checkpointing), each streaming a block-scaled FP8 checkpoint into its shards, and cp=2
(ring; all-gather of the latent or of the expanded K/V) and cp=4, tp=2 and tp=2 x cp=2: loss and
every gradient; the auxiliary-loss-free bias update leaves every rank with the same bias, bit for
bit, as the single process (also through the Trainer)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from plait.models import (
    ActivationCheckpointing,
    ParallelConfig,
    from_pretrained,
    load_hf_checkpoint,
    load_hf_config,
    parallelize,
    save_hf_checkpoint,
)
from plait.models.deepseek_v3 import DeepseekV3Config, DeepseekV3ForCausalLM
from plait.moe import update_expert_biases
from safetensors.torch import load_file, save_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

dist_testing = pytest.importorskip("plait.dist_core.testing")
run_distributed = dist_testing.run_distributed

DENSE = ("pp", "dp_replicate", "dp_cp_shard", "cp_replicate", "tp")
EXPERT = ("pp", "ep_replicate", "ep_shard")
CFG = dict(
    vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
    moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
    n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8,
    qk_rope_head_dim=4, v_head_dim=6, initializer_range=0.2, bias_update_rate=0.01,
)  # fmt: skip
BLOCK = [8, 16]


def _materialize(model, ckpt: str) -> None:
    """Materialise the sharded meta model, load ``ckpt`` into its shards, and make FSDP sum its
    gradients (like plait.loop; gloo has no PREMUL_SUM)."""
    from torch.distributed.fsdp import FSDPModule

    model.to_empty(device="cpu")
    model.reset_parameters()
    load_hf_checkpoint(model, ckpt)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 128, (4, 8), generator=g)
    labels = torch.randint(0, 128, (4, 8), generator=g)
    labels[0, :3] = -100
    return ids, labels


def _to_fp8(src, dst) -> None:
    """``src`` as a block-scaled FP8 checkpoint (every decoder linear but the router)."""
    dst.mkdir()
    out = {}
    for k, v in load_file(src / "model.safetensors").items():
        if k.startswith("model.layers.") and (k.endswith("proj.weight") or "proj_with_mqa" in k):
            br, bc = BLOCK
            blocks = torch.nn.functional.pad(v, (0, -v.shape[1] % bc, 0, -v.shape[0] % br))
            blocks = blocks.unflatten(0, (-1, br)).unflatten(2, (-1, bc))  # [R/br, br, C/bc, bc]
            scale = blocks.abs().amax(dim=(1, 3)) / 448.0
            full = scale.repeat_interleave(br, 0).repeat_interleave(bc, 1)[: v.shape[0], : v.shape[1]]
            out[k], out[k + "_scale_inv"] = (v / full).to(torch.float8_e4m3fn), scale
        else:
            out[k] = v
    save_file(out, dst / "model.safetensors")
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": BLOCK}
    (dst / "config.json").write_text(json.dumps(cfg))


def _rank_main(layout: str, ckpt: str) -> dict:
    world = dist.get_world_size()
    cfg = load_hf_config(ckpt).model_copy(update={"bias_update_rate": 0.01})  # FP8: with its block size
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(cfg)
    if layout.startswith("ep2_fsdp2"):
        from plait.dist_core import DeviceMeshParameters, DistributedContext

        ctx = DistributedContext.from_env(DeviceMeshParameters(data_shard=2, expert=2), device="cpu")
        # full activation checkpointing: the recomputed forwards must not count the tokens again
        ac = ActivationCheckpointing(mode="full")
        parallelize(model, context=ctx, config=ParallelConfig(activation_checkpointing=ac))
        bias_group = ctx.mesh_for("batch")["dp", "cp"]  # what the loop sums the counts over
        assert all(isinstance(m.experts.gate_up_proj, DTensor) for m in model.moe_layers())
    else:
        dense = init_device_mesh("cpu", (1, 1, world, 1, 1), mesh_dim_names=DENSE)
        expert = init_device_mesh("cpu", (1, world, 1), mesh_dim_names=EXPERT)
        parallelize(model, dense_mesh=dense, expert_mesh=expert, config=ParallelConfig())
        bias_group = dense["dp_cp_shard"].get_group()
    _materialize(model, ckpt)  # each rank reads (and dequantizes) only its shards
    ids, labels = _batch()
    rank = dist.get_rank()
    rows = slice(rank * 4 // world, (rank + 1) * 4 // world)
    out = model(input_ids=ids[rows], labels=labels[rows])
    global_tokens = int((labels != -100).sum())
    (out["loss_sum"] / global_tokens).backward()
    loss_sum = out["loss_sum"].detach().clone()
    dist.all_reduce(loss_sum)
    grads = {n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad.clone()
             for n, p in model.named_parameters()}  # fmt: skip
    assert update_expert_biases(model, bias_group) == 2
    biases = [m.router.expert_bias.clone() for m in model.moe_layers()]
    return {"loss": loss_sum.item() / global_tokens, "grads": grads if rank == 0 else None, "biases": biases}


def _reference(tmp_path, fp8: bool):
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**CFG))
    model.reset_parameters()
    with torch.no_grad():
        for m in model.moe_layers():
            m.router.expert_bias.normal_(0.0, 0.3)
    ckpt = save_hf_checkpoint(model, tmp_path / "seed")
    if fp8:
        _to_fp8(ckpt, tmp_path / "fp8")
        ckpt = tmp_path / "fp8"
        model = from_pretrained(ckpt, bias_update_rate=0.01)
    ids, labels = _batch()
    out = model(input_ids=ids, labels=labels)
    out["loss"].backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    update_expert_biases(model)
    return out["loss"].item(), grads, [m.router.expert_bias.clone() for m in model.moe_layers()], str(ckpt)


@pytest.mark.parametrize("layout", ["fsdp2_fp8", "ep2_fsdp2_fp8"])
def test_layout_matches_single_process_and_biases_agree(layout, tmp_path):
    ref_loss, ref_grads, ref_biases, ckpt = _reference(tmp_path, fp8=layout.endswith("fp8"))
    results = run_distributed(_rank_main, 2, layout, ckpt, timeout=240.0)
    for r in results:
        assert r["loss"] == pytest.approx(ref_loss, abs=1e-5)
        for got, want in zip(r["biases"], ref_biases, strict=True):
            assert torch.equal(got, want)  # every rank, bit for bit, as the single process
    grads = results[0]["grads"]
    assert set(grads) == set(ref_grads)
    for name, ref in ref_grads.items():
        torch.testing.assert_close(grads[name], ref, atol=1e-5, rtol=1e-4, msg=name)


def _tp_sharded(p: DTensor) -> bool:
    names = p.device_mesh.mesh_dim_names or ()
    return "tp" in names and p.placements[names.index("tp")].is_shard()


def _tp_rank(ckpt: str, tp: int, cp: int) -> dict:
    from plait.dist_core import DeviceMeshParameters, DistributedContext, shard_batch

    ctx = DistributedContext.from_env(DeviceMeshParameters(tensor=tp, context_shard=cp), device="cpu")
    cfg = load_hf_config(ckpt).model_copy(update={"attn_implementation": "sdpa"})
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(cfg)
    parallelize(model, context=ctx, config=ParallelConfig())
    attn = model.model.layers["0"].self_attn
    sharded = [n for n, p in attn.named_parameters() if isinstance(p, DTensor) and _tp_sharded(p)]
    _materialize(model, ckpt)
    ids, labels = _batch()
    batch = {"input_ids": ids, "labels": labels}
    batch["position_ids"] = torch.cat([torch.arange(3), torch.arange(5)]).expand(4, 8)
    out = model(**shard_batch(batch, cp, ctx.mesh_for("batch")["cp"].get_local_rank()))
    global_tokens = int((labels != -100).sum())
    (out["loss_sum"] / global_tokens).backward()
    loss_sum = out["loss_sum"].detach().clone()
    if cp > 1:
        dist.all_reduce(loss_sum, group=ctx.mesh_for("batch")["cp"].get_group())
    grads = {n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad.clone()
             for n, p in model.named_parameters()}  # fmt: skip
    return {"loss": loss_sum.item() / global_tokens, "grads": grads, "sharded": sharded}


@pytest.mark.parametrize(
    ("q_lora_rank", "tp", "cp"), [(24, 2, 1), (None, 2, 1), (24, 2, 2)], ids=["q_lora", "q_proj", "tp2_cp2"]
)
def test_tensor_parallel_matches_single_process(q_lora_rank, tp, cp, tmp_path):
    """Heads sharded over tp = 2 (also with cp = 2, the latent all-gathered): every rank's loss and
    every weight gradient (replicated kv_a_proj_with_mqa and latent norms included, whose rope-key
    part is read by each rank's heads) equal the single-process model's."""
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**{**CFG, "q_lora_rank": q_lora_rank}))
    model.reset_parameters()
    ckpt = str(save_hf_checkpoint(model, tmp_path / "seed"))
    ids, labels = _batch()
    positions = torch.cat([torch.arange(3), torch.arange(5)]).expand(4, 8)
    ref = model(input_ids=ids, labels=labels, position_ids=positions)
    ref["loss"].backward()
    results = run_distributed(_tp_rank, tp * cp, ckpt, tp, cp, timeout=240.0)
    q = "q_b_proj" if q_lora_rank else "q_proj"
    for r in results:
        assert sorted(r["sharded"]) == sorted([f"{q}.weight", "kv_b_proj.weight", "o_proj.weight"])
        assert r["loss"] == pytest.approx(ref["loss"].item(), abs=1e-5)
        for name, p in model.named_parameters():
            torch.testing.assert_close(r["grads"][name], p.grad, atol=1e-5, rtol=1e-4, msg=name)


def _tp_error_rank(heads: int) -> str:
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(DeepseekV3Config(**{**CFG, "num_attention_heads": heads}))
    dense = init_device_mesh("cpu", (1, 1, 1, 1, 2), mesh_dim_names=DENSE)
    try:
        parallelize(model, dense_mesh=dense, config=ParallelConfig())
    except ValueError as e:
        return str(e)
    return "no error"


def test_tensor_parallel_needs_whole_heads_per_rank():
    for message in run_distributed(_tp_error_rank, 2, 3):
        assert message == "tensor parallel size 2 does not divide config.num_attention_heads=3"


TRAINER_CFG = dict(vocab_size=32, n_group=1, topk_group=1)  # the loop tests' vocabulary; no groups


def _trainer_worker(run_dir: str, steps: int, dp: int, ckpt: str) -> list[torch.Tensor]:
    from plait.loop import CausalLMTask, DatasetProvider, Trainer, load_config, pack_documents
    from plait.models import CausalLMProvider

    from tests.loop._lm import VOCAB, pattern_tokens

    assert TRAINER_CFG["vocab_size"] == VOCAB

    cfg = load_config(
        overrides=[
            f"--run.run_dir={run_dir}", f"--run.steps={steps}", f"--mesh.data_shard={dp}", f"--mesh.expert={dp}",
            "--batching.global_batch_size=4", "--batching.microbatch_size=2", "--batching.seq_len=16",
            "--optimizer.lr=0.01", "--logging.progress_bar=false",
        ]
    )  # fmt: skip
    model_cfg = DeepseekV3Config(**{**CFG, **TRAINER_CFG})
    provider = CausalLMProvider(model_cfg, parallel=ParallelConfig(), init_from=ckpt)
    tr = Trainer(
        cfg, provider, DatasetProvider(pack_documents(pattern_tokens(), 16, eos_id=VOCAB - 1)), CausalLMTask()
    )
    tr.fit()
    tr.close()
    return [m.router.expert_bias.clone() for m in CausalLMProvider.moe_layers(tr.model_parts)]


def test_trainer_updates_the_biases_alike_on_every_rank(tmp_path):
    """The Trainer calls the provider's bias update after each optimizer step: under EP=2 x FSDP2 both
    ranks hold the same biases, bit for bit, each moved by +-rate per step (its first step's counts are
    those of the whole global batch, so they equal the single-process run's first update)."""
    torch.manual_seed(0)
    seed = DeepseekV3ForCausalLM(DeepseekV3Config(**{**CFG, **TRAINER_CFG}))
    seed.reset_parameters()
    ckpt = str(save_hf_checkpoint(seed, tmp_path / "seed"))
    one = _trainer_worker(str(tmp_path / "one"), 1, 1, ckpt)
    first = run_distributed(_trainer_worker, 2, str(tmp_path / "ep_1"), 1, 2, ckpt)
    for rank in first:
        for got, want in zip(rank, one, strict=True):
            assert torch.equal(got, want)
    ranks = run_distributed(_trainer_worker, 2, str(tmp_path / "ep"), 3, 2, ckpt)
    for a, b in zip(ranks[0], ranks[1], strict=True):
        assert torch.equal(a, b)
        steps = a / 0.01
        assert torch.allclose(steps, steps.round(), atol=1e-4) and a.abs().max() > 0  # +-rate (or 0) per step


def _cp_rank(mode: str, ckpt: str, size: int, docs: bool, ac: str = "none", compile: bool = False) -> dict:
    from plait.dist_core import DeviceMeshParameters, DistributedContext, shard_batch
    from plait.models.deepseek_v3 import MultiHeadLatentAttention

    ctx = DistributedContext.from_env(DeviceMeshParameters(context_shard=size), device="cpu")
    cfg = load_hf_config(ckpt).model_copy(update={"attn_implementation": "sdpa"})
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(cfg)
    attention = mode.split("_")[0]
    checkpointing = ActivationCheckpointing(mode=ac)
    config = ParallelConfig(
        context_parallel_attention=attention, activation_checkpointing=checkpointing, compile=compile
    )
    parallelize(model, context=ctx, config=config)
    for m in model.modules():
        if isinstance(m, MultiHeadLatentAttention) and mode.endswith("expanded"):
            m.context_gather = "expanded"
    _materialize(model, ckpt)
    ids, labels = _batch()
    batch = {"input_ids": ids, "labels": labels}
    if docs:
        batch["position_ids"] = torch.cat([torch.arange(3), torch.arange(5)]).expand(4, 8)  # cross the ranks
    shard = shard_batch(batch, size, ctx.mesh_for("batch")["cp"].get_local_rank())
    cp_group = ctx.mesh_for("batch")["cp"].get_group()
    gathered: list[int] = []  # values per token of the attention's all-gathers over the context group
    all_gather = dist.all_gather_into_tensor

    def counting(out, x, group=None, **kw):
        if group is cp_group and x.dim() > 2:  # not FSDP's flat parameter gathers
            gathered.append(x.numel() // ids[:, : 8 // size].numel())
        return all_gather(out, x, group=group, **kw)

    dist.all_gather_into_tensor = counting
    try:
        out = model(**shard)
    finally:
        dist.all_gather_into_tensor = all_gather
    global_tokens = int((labels != -100).sum())
    (out["loss_sum"] / global_tokens).backward()
    loss_sum = out["loss_sum"].detach().clone()
    dist.all_reduce(loss_sum)
    grads = {n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad.clone()
             for n, p in model.named_parameters()}  # fmt: skip
    return {"loss": loss_sum.item() / global_tokens, "grads": grads, "gathered": gathered}


@pytest.mark.parametrize(
    ("mode", "size", "docs", "ac"),
    [
        ("allgather", 2, True, "none"),
        ("allgather", 2, False, "full"),
        ("allgather", 4, True, "none"),
        ("allgather_expanded", 2, True, "none"),
        ("ring", 2, True, "none"),
    ],
)
def test_context_parallel_matches_single_process(mode, size, docs, ac, tmp_path):
    """cp = 2 and 4, with packed documents crossing the ranks and without: the all-gather mode moves
    the latent (kv_lora_rank + qk_rope_head_dim = 20 values a token) or, with ``context_gather =
    "expanded"``, the keys and values (2 x 4 heads x 12, v's head size 6 padded to q/k's 12); the
    ring moves K/V. Loss and every weight gradient equal the single-process model's (also under full
    activation checkpointing, whose recomputed forward gathers again)."""
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**CFG))
    model.reset_parameters()
    ckpt = str(save_hf_checkpoint(model, tmp_path / "seed"))
    ids, labels = _batch()
    positions = torch.cat([torch.arange(3), torch.arange(5)]).expand(4, 8) if docs else None
    ref = model(input_ids=ids, labels=labels, position_ids=positions)
    ref["loss"].backward()
    results = run_distributed(_cp_rank, size, mode, ckpt, size, docs, ac, timeout=240.0)
    widths = {"allgather": [20] * 3, "allgather_expanded": [2 * 4 * 12] * 3, "ring": []}[mode]
    for r in results:
        assert r["loss"] == pytest.approx(ref["loss"].item(), abs=1e-5)
        assert r["gathered"] == widths  # per token, one all-gather per layer
    for name, p in model.named_parameters():
        torch.testing.assert_close(results[0]["grads"][name], p.grad, atol=1e-5, rtol=1e-4, msg=name)


def _mtp_rank(ckpt: str, layout: str) -> dict:
    cfg = load_hf_config(ckpt).model_copy(update={"mtp_loss_weight": 0.3})
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(cfg)
    tp = layout == "tp2"
    dense = init_device_mesh("cpu", (1, 1, 1, 1, 2) if tp else (1, 1, 2, 1, 1), mesh_dim_names=DENSE)
    expert = init_device_mesh("cpu", (1, 2, 1), mesh_dim_names=EXPERT)
    parallelize(model, dense_mesh=dense, expert_mesh=expert, config=ParallelConfig())
    _materialize(model, ckpt)  # the MTP module's shards too
    ids, labels = _batch()
    out = model(input_ids=ids, labels=labels)  # both ranks the whole batch: summed grads = 2 x
    (out["loss"] + out["aux_loss"]).backward()
    grads = {n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad.clone()
             for n, p in model.named_parameters()}  # fmt: skip
    return {"mtp": out["mtp_loss"].item(), "grads": grads}


@pytest.mark.parametrize("layout", ["fsdp2", "tp2"])
def test_mtp_under_fsdp2_and_tp2_matches_single_process(layout, tmp_path):
    """The MTP module (not sharded by tp: it runs replicated) under FSDP2 and under tp=2: its loss and
    every gradient equal one process's (FSDP2: both ranks took the whole batch, so twice)."""
    cfg = DeepseekV3Config(**{**CFG, "mtp_loss_weight": 0.3})
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(cfg)
    model.reset_parameters()
    ckpt = str(save_hf_checkpoint(model, tmp_path / "seed"))  # with the MTP module
    ids, labels = _batch()
    out = model(input_ids=ids, labels=labels)
    (out["loss"] + out["aux_loss"]).backward()
    assert model.mtp is not None and float(out["mtp_loss"]) > 0
    results = run_distributed(_mtp_rank, 2, ckpt, layout, timeout=240.0)
    for r in results:
        assert r["mtp"] == pytest.approx(out["mtp_loss"].item(), abs=1e-6)
    ranks = 1 if layout == "tp2" else 2
    for name, p in model.named_parameters():
        torch.testing.assert_close(results[0]["grads"][name], ranks * p.grad, atol=1e-5, rtol=1e-4, msg=name)
