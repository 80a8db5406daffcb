"""Loss and gradients of parallel layouts (gloo, CPU) equal the single-process model's.

Each rank builds the model on meta, applies the parallel plan, loads the same Hugging Face
checkpoint straight into its shards (reading only its part), runs its data-parallel slice of the
batch and returns the loss and the gathered full gradients. Gradient reduction is by *sum* (the
loop's convention: objective = local token-sum loss / global token count).
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed as dist
from plait.loop.grads import prepare_fsdp_for_sum
from plait.models import (
    ActivationCheckpointing,
    ParallelConfig,
    load_hf_checkpoint,
    parallelize,
    save_hf_checkpoint,
)
from plait.models.qwen3 import Qwen3ForCausalLM, Qwen3MoeConfig
from plait.moe import AllGatherDispatcher, AllToAllDispatcher, DeepEPDispatcher
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from ..moe._fake_deep_ep import fake_deep_ep
from ._families import SMALL

dist_testing = pytest.importorskip("plait.dist_core.testing")
run_distributed = dist_testing.run_distributed

DENSE = ("pp", "dp_replicate", "dp_cp_shard", "cp_replicate", "tp")
EXPERT = ("pp", "ep_replicate", "ep_shard")

CFG = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_experts=4,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    mlp_only_layers=(1,),
    router_aux_loss_coef=0.0,
    initializer_range=0.2,
)

# family -> (causal LM class, config class, config kwargs)
FAMILIES: dict[str, tuple[type, type, dict]] = {"qwen3_moe": (Qwen3ForCausalLM, Qwen3MoeConfig, CFG), **SMALL}


def _model(family: str, tied: bool, **kw) -> nn.Module:
    cls, cfg_cls, cfg = FAMILIES[family]
    return cls(cfg_cls(**{**cfg, "tie_word_embeddings": tied}), **kw)


# layout -> (world, dense mesh shape, expert mesh shape, parallel config kwargs). Layouts named
# "ctx_*" build plait.dist_core's DistributedContext from the matching degrees instead of meshes.
LAYOUTS = {
    "fsdp2": (2, (1, 1, 2, 1, 1), (1, 2, 1), {}),
    # two decoder layers per FSDP unit (layers 0-1, then 2); with EP the experts stay out of the units
    "fsdp2_units2": (2, (1, 1, 2, 1, 1), (1, 2, 1), {"fsdp_layers_per_unit": 2}),
    # the embedding's rows sharded over the FSDP ranks, no unit (with EP: the all-gather dispatch)
    "fsdp2_rows": (2, (1, 1, 2, 1, 1), (1, 2, 1), {"shard_embedding_rows": True}),
    "ctx_ep2_fsdp2_all_gather_rows": (
        2,
        (1, 1, 2, 1, 1),
        (1, 1, 2),
        {"expert_dispatch": "all_gather", "shard_embedding_rows": True},
    ),
    "ctx_ep2_fsdp2_units2": (2, (1, 1, 2, 1, 1), (1, 1, 2), {"fsdp_layers_per_unit": 2}),
    "ctx_ep2_fsdp2": (2, (1, 1, 2, 1, 1), (1, 1, 2), {}),
    "ctx_ep2_fsdp2_deepep": (2, (1, 1, 2, 1, 1), (1, 1, 2), {"expert_dispatch": "deepep"}),
    "ctx_ep2_fsdp2_chunks4": (2, (1, 1, 2, 1, 1), (1, 1, 2), {"expert_chunks": 4}),
    "ctx_ep2_fsdp2_all_gather": (2, (1, 1, 2, 1, 1), (1, 1, 2), {"expert_dispatch": "all_gather"}),
    # a bounded expert buffer: 48 of the exact 64 rows per rank (16 tokens, top-2)
    "ctx_ep2_fsdp2_all_gather_buffer": (
        2,
        (1, 1, 2, 1, 1),
        (1, 1, 2),
        {"expert_dispatch": "all_gather", "expert_buffer_factor": 1.5},
    ),
    "ep2_hsdp2x2": (4, (1, 2, 2, 1, 1), (1, 2, 2), {}),
    "hsdp2x2": (4, (1, 2, 2, 1, 1), (1, 4, 1), {}),
    "tp2": (2, (1, 1, 1, 1, 2), (1, 2, 1), {}),
    "tp2_fsdp2_ac": (
        4,
        (1, 1, 2, 1, 2),
        (1, 4, 1),
        {"activation_checkpointing": ActivationCheckpointing(mode="selective", every=2)},
    ),
}


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 128, (4, 8), generator=g)
    labels = torch.randint(0, 128, (4, 8), generator=g)
    labels[0, :3] = -100
    return ids, labels


def _rank_main(layout: str, ckpt: str, tied: bool, family: str = "qwen3_moe") -> dict:
    if LAYOUTS[layout][3].get("expert_dispatch") != "deepep":
        return _rank_run(layout, ckpt, tied, family)
    # DeepEP cannot be built here: its Buffer API over gloo (tests/moe/_fake_deep_ep.py).
    with fake_deep_ep() as buffer:
        result = _rank_run(layout, ckpt, tied)
    # 2 MoE layers: forward dispatch + combine each, then their backwards.
    assert buffer.calls.count("dispatch") == buffer.calls.count("combine") == 4, buffer.calls
    return result


def _rank_run(layout: str, ckpt: str, tied: bool, family: str = "qwen3_moe") -> dict:
    world, dshape, eshape, pkw = LAYOUTS[layout]
    assert dist.get_world_size() == world
    with torch.device("meta"):
        model = _model(family, tied)
    if layout.startswith("ctx_"):
        from plait.dist_core import DeviceMeshParameters, DistributedContext

        params = DeviceMeshParameters(
            data_replicate=dshape[1], data_shard=dshape[2], tensor=dshape[4], expert=eshape[2]
        )
        ctx = DistributedContext.from_env(params, device="cpu")
        dense = ctx.mesh_for("dense")
        parallelize(model, context=ctx, config=ParallelConfig(**pkw))
    else:
        dense = init_device_mesh("cpu", dshape, mesh_dim_names=DENSE)
        expert = init_device_mesh("cpu", eshape, mesh_dim_names=EXPERT)
        parallelize(model, dense_mesh=dense, expert_mesh=expert, config=ParallelConfig(**pkw))
    dispatcher = {"deepep": DeepEPDispatcher, "all_gather": AllGatherDispatcher}.get(
        pkw.get("expert_dispatch", ""), AllToAllDispatcher
    )
    if eshape[2] > 1:
        assert all(isinstance(moe.dispatcher, dispatcher) for moe in model.moe_layers())
    if dshape[4] > 1:  # sink logits sharded by head, like the column-parallel q/k/v heads
        for layer in model.decoder_layers():
            sinks = layer.self_attn.sinks
            if sinks is not None:
                assert isinstance(sinks, DTensor) and sinks.placements[-1] == Shard(0), sinks
    if "expert_chunks" in pkw:
        assert all(moe.dispatcher.num_chunks == pkw["expert_chunks"] for moe in model.moe_layers())
    if "expert_buffer_factor" in pkw:
        factor = pkw["expert_buffer_factor"]
        assert all(moe.dispatcher.buffer_factor == factor for moe in model.moe_layers())
    if dshape[1] * dshape[2] > 1:  # FSDP: one parameter group (all-gather, reduce-scatter) per unit
        from torch.distributed.fsdp import FSDPModule, fully_shard

        layers = list(model.decoder_layers())
        groups = [fully_shard.state(layer)._fsdp_param_group for layer in layers]  # type: ignore[attr-defined]
        per_unit = pkw.get("fsdp_layers_per_unit", 1)
        assert [groups.index(g) for g in groups] == [i // per_unit * per_unit for i in range(len(layers))]
        # the embedding and the head in units of their own, unless they share a weight (then the root's)
        # or the embedding's rows are sharded (then it is none)
        rows = pkw.get("shard_embedding_rows", False)
        ends = (model.model.embed_tokens, model.lm_head)
        assert [isinstance(m, FSDPModule) for m in ends] == [not tied and not rows, not tied]
        assert (model.model.embed_tokens.row_mesh is not None) == rows
    # The training path: materialise the sharded meta model and initialise it in place...
    model.to_empty(device="cpu")
    model.reset_parameters()
    for name, p in model.named_parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        assert torch.isfinite(local).all(), name
    # ...then overwrite it with the checkpoint, each rank reading only its shards.
    load_hf_checkpoint(model, ckpt)
    prepare_fsdp_for_sum([model])  # sum, as plait.loop reduces (a plain SUM: gloo has no PREMUL_SUM)
    ids, labels = _batch()
    dp_size = dshape[1] * dshape[2]
    dp_rank = dense["dp_replicate"].get_local_rank() * dshape[2] + dense["dp_cp_shard"].get_local_rank()
    rows = slice(dp_rank * 4 // dp_size, (dp_rank + 1) * 4 // dp_size)
    out = model(input_ids=ids[rows], labels=labels[rows])
    global_tokens = int((labels != -100).sum())
    (out["loss_sum"] / global_tokens).backward()
    loss_sum = out["loss_sum"].detach().clone()
    dp_group = dense["dp_replicate", "dp_cp_shard"]._flatten().get_group() if dp_size > 1 else None
    if dp_group is not None:
        dist.all_reduce(loss_sum, group=dp_group)
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad
        grads[name] = g.full_tensor() if isinstance(g, DTensor) else g.clone()
    return {"loss": loss_sum.item() / global_tokens, "grads": grads if dist.get_rank() == 0 else None}


def _reference(tied: bool, tmp_path, family: str = "qwen3_moe") -> tuple[float, dict[str, torch.Tensor], str]:
    torch.manual_seed(0)
    model = _model(family, tied)
    model.reset_parameters()
    ckpt = save_hf_checkpoint(model, tmp_path / "seed")
    ids, labels = _batch()
    out = model(input_ids=ids, labels=labels)
    out["loss"].backward()
    return out["loss"].item(), {n: p.grad for n, p in model.named_parameters()}, str(ckpt)


def _run_and_check(layout: str, tied: bool, tmp_path, family: str = "qwen3_moe") -> list[dict]:
    ref_loss, ref_grads, ckpt = _reference(tied, tmp_path, family)
    world = LAYOUTS[layout][0]
    results = run_distributed(_rank_main, world, layout, ckpt, tied, family, timeout=240.0)
    for r in results:
        assert r["loss"] == pytest.approx(ref_loss, abs=1e-5)
    grads = results[0]["grads"]
    assert set(grads) == set(ref_grads)
    for name, ref in ref_grads.items():
        torch.testing.assert_close(grads[name], ref, atol=1e-5, rtol=1e-4, msg=name)
    return results


@pytest.mark.parametrize("layout", sorted(k for k in LAYOUTS if not k.endswith("_deepep")))
def test_layout_matches_single_process(layout, tmp_path):
    _run_and_check(layout, layout == "tp2", tmp_path)


# The other families in the layouts that exercise what they add: Llama's dense blocks (attention
# and MLP biases) under FSDP2, HSDP, TP and TP x FSDP2 with checkpointing; gpt-oss's experts (with
# biases) under EP and both dispatches, its sinks sharded by head under TP, its sliding window.
FAMILY_LAYOUTS = [
    ("llama", "fsdp2", False),
    ("llama", "hsdp2x2", False),
    ("llama", "tp2", True),
    ("llama", "tp2_fsdp2_ac", False),
    ("gpt_oss", "fsdp2", False),
    ("gpt_oss", "ctx_ep2_fsdp2", False),
    ("gpt_oss", "ctx_ep2_fsdp2_all_gather", False),
    ("gpt_oss", "tp2", True),
]


@pytest.mark.parametrize(("family", "layout", "tied"), FAMILY_LAYOUTS)
def test_family_layout_matches_single_process(family, layout, tied, tmp_path):
    _run_and_check(layout, tied, tmp_path, family)


def test_deepep_dispatch_matches_all_to_all(tmp_path):
    """``ParallelConfig(expert_dispatch="deepep")`` routes EP=2 through DeepEPDispatcher (fake buffer)."""
    deepep = _run_and_check("ctx_ep2_fsdp2_deepep", False, tmp_path / "deepep")
    all_to_all = _run_and_check("ctx_ep2_fsdp2", False, tmp_path / "a2a")
    assert [r["loss"] for r in deepep] == pytest.approx([r["loss"] for r in all_to_all], abs=1e-6)
    for name, g in all_to_all[0]["grads"].items():
        torch.testing.assert_close(deepep[0]["grads"][name], g, atol=1e-6, rtol=1e-5, msg=name)


def _missing_deepep_worker() -> str:
    cfg = Qwen3MoeConfig(**CFG)
    with torch.device("meta"):
        model = Qwen3ForCausalLM(cfg)
    expert = init_device_mesh("cpu", (1, 1, 2), mesh_dim_names=EXPERT)
    # Neither rank may leave (and rank 0 tear down the store) while the other still builds the mesh's group.
    dist.barrier()
    saved = sys.modules.get("deep_ep")
    sys.modules["deep_ep"] = None  # type: ignore[assignment]  # `import deep_ep` fails, as when absent
    try:
        parallelize(model, expert_mesh=expert, config=ParallelConfig(expert_dispatch="deepep"))
    except ImportError as e:
        return str(e)
    finally:
        if saved is None:
            del sys.modules["deep_ep"]
        else:
            sys.modules["deep_ep"] = saved
    return "no error"


def test_deepep_dispatch_without_deep_ep_names_the_extra():
    for msg in run_distributed(_missing_deepep_worker, 2):
        assert "plait-moe[deepep]" in msg


def test_expert_buffer_factor_config() -> None:
    from pydantic import ValidationError

    cfg = ParallelConfig(expert_dispatch="all_gather", expert_buffer_factor=1.5)
    assert cfg.expert_buffer_factor == 1.5 and ParallelConfig().expert_buffer_factor is None
    for bad in (0.5, float("inf"), float("nan")):
        with pytest.raises(ValidationError, match="expert_buffer_factor"):
            ParallelConfig(expert_dispatch="all_gather", expert_buffer_factor=bad)
    with pytest.raises(ValidationError, match=r"expert_buffer_factor applies to parallel\.expert_dispatch"):
        ParallelConfig(expert_buffer_factor=2.0)  # the default dispatch is all_to_all
    with pytest.raises(ValidationError, match=r"not 'all_to_all'"):
        ParallelConfig(compile=True, cuda_graphs=True, expert_dispatch="all_to_all", expert_buffer_factor=2.0)
    # unset under CUDA graphs: the all-gather dispatch, the one a graph captures
    assert ParallelConfig(compile=True, cuda_graphs=True, expert_buffer_factor=2.0).dispatch == "all_gather"


def test_expert_dispatch_unset_is_all_gather_under_cuda_graphs_and_all_to_all_otherwise() -> None:
    assert ParallelConfig().expert_dispatch is None and ParallelConfig().dispatch == "all_to_all"
    assert ParallelConfig(compile=True, cuda_graphs=True).dispatch == "all_gather"
    for chosen in ("all_to_all", "all_gather", "deepep"):  # a value set is kept, graphs or not
        assert ParallelConfig(expert_dispatch=chosen).dispatch == chosen
        assert ParallelConfig(compile=True, cuda_graphs=True, expert_dispatch=chosen).dispatch == chosen
