"""Pipeline stages: layer split, chained stages == whole model (with MoE aux loss), PP=2 on gloo."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from plait.models import load_hf_checkpoint, save_hf_checkpoint, stage_layer_ids
from plait.models.qwen3 import Qwen3ForCausalLM, Qwen3MoeConfig

from ._families import SMALL

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
    mlp_only_layers=(1,),
    initializer_range=0.2,
)


def test_stage_layer_ids_even_split():
    assert [stage_layer_ids(7, s, 3) for s in range(3)] == [[0, 1, 2], [3, 4], [5, 6]]
    assert [stage_layer_ids(4, s, 2) for s in range(2)] == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="num_stages"):
        stage_layer_ids(2, 0, 3)


def _batch():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 128, (4, 8), generator=g)
    labels = torch.randint(0, 128, (4, 8), generator=g)
    labels[1, :2] = -100
    return ids, labels


@pytest.mark.parametrize("pooling", ["all_layers", "per_layer"])
def test_chained_stages_match_whole_model(pooling):
    """Stage modules own disjoint parameters with the whole model's names; chaining their dict IO
    reproduces the whole model's loss, MoE aux loss (pooled over the layers of both stages or
    summed per layer) and gradients."""
    cfg = Qwen3MoeConfig(**CFG, router_aux_loss_coef=0.1, router_aux_loss_pooling=pooling)
    torch.manual_seed(0)
    full = Qwen3ForCausalLM(cfg)
    full.reset_parameters()
    stages = [Qwen3ForCausalLM(cfg, stage_index=s, num_stages=2) for s in range(2)]
    sd = full.state_dict()
    for st in stages:
        st.load_state_dict({k: v for k, v in sd.items() if k in st.state_dict()}, strict=True)
    assert set(stages[0].state_dict()) | set(stages[1].state_dict()) == set(sd)
    assert stages[0].lm_head is None and stages[1].model.embed_tokens is None
    ids, labels = _batch()
    mask = torch.ones_like(ids)
    mask[2, :3] = 0  # a left-padded row: padding is left out of attention, loss and aux loss
    ref = full(input_ids=ids, labels=labels, attention_mask=mask)
    (ref["loss"] + ref["aux_loss"]).backward()
    out0 = stages[0](input_ids=ids, attention_mask=mask)
    pooled = {"router_stats"} if pooling == "all_layers" else set()
    assert set(out0) == {"hidden_states", "aux_loss"} | pooled
    out1 = stages[1](**out0, labels=labels, attention_mask=mask)
    (out1["loss"] + out1["aux_loss"]).backward()
    torch.testing.assert_close(out1["loss"], ref["loss"])
    torch.testing.assert_close(out1["aux_loss"], ref["aux_loss"])
    assert ref["aux_loss"].item() > 0
    grads = {n: p.grad for st in stages for n, p in st.named_parameters()}
    for n, p in full.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, atol=1e-6, rtol=1e-5, msg=n)


SCHEDULES = {"1f1b": {"kind": "1f1b"}, "zbv": {"kind": "zbv"}}
# Every schedule kind for the other families (single-stage, looped and V-shaped placements).
FAMILY_SCHEDULES = {
    "gpipe": {"kind": "gpipe"},
    "1f1b": {"kind": "1f1b"},
    "interleaved_1f1b": {"kind": "interleaved_1f1b", "stages_per_rank": 2},
    "zbv": {"kind": "zbv"},
    "dualpipev": {"kind": "dualpipev"},
}


def _pp_model(family: str, **stage: int) -> torch.nn.Module:
    if family == "qwen3_moe":
        return Qwen3ForCausalLM(
            Qwen3MoeConfig(**{**CFG, "num_hidden_layers": 4}, router_aux_loss_coef=0.0), **stage
        )
    cls, cfg_cls, kwargs = SMALL[family]
    # An odd layer count: 5 layers over 2 stages (3 + 2) or 4 stages (2 + 1 + 1 + 1).
    return cls(cfg_cls(**{**kwargs, "num_hidden_layers": 5}), **stage)


def _pp_rank(ckpt: str, schedule: str, family: str = "qwen3_moe", compiled: bool = False) -> dict:
    from plait.pipelining import Chunk, PipelineState, Stack, build_pipeline, parse_schedule_config

    spec = SCHEDULES[schedule] if family == "qwen3_moe" else FAMILY_SCHEDULES[schedule]
    microbatches = 2 if family == "qwen3_moe" else 4
    config = parse_schedule_config({**spec, "num_microbatches": microbatches, "loss_reduction": "sum"})
    topo = config.topology(2)
    rank = dist.get_rank()
    stages = {}
    for s in topo.stages_of(rank):
        with torch.device("meta"):
            stages[s] = _pp_model(family, stage_index=s, num_stages=topo.num_stages)
    load_hf_checkpoint(list(stages.values()), ckpt)
    if compiled:  # one backward node per layer, as parallel.compile makes it (inductor's kernels aside)
        for st in stages.values():
            for layer in st.decoder_layers():
                layer.compile(backend="aot_eager", fullgraph=True)
    last = topo.num_stages - 1
    ids, labels = _batch()
    global_tokens = int((labels != -100).sum())

    def loss_fn(out, mb):
        return out["loss_sum"] / global_tokens

    def kwargs_fn(s, mb):
        return {"labels": mb["labels"]} if s == last else {}

    executor = build_pipeline(
        config,
        pp_group=dist.group.WORLD,
        stage_modules=stages,
        loss_fn=loss_fn,
        forward_kwargs_fn=kwargs_fn,
    )
    state = PipelineState(microbatches, specs={"labels": Chunk(0), "loss": Stack()})
    state.global_view["labels"] = labels
    result = executor.step({"input_ids": ids} if rank == 0 else None, state)
    return {
        "loss": None if result.loss is None else float(result.loss),
        "grads": {
            n: None if p.grad is None else p.grad.clone()
            for st in stages.values()
            for n, p in st.named_parameters()
        },
    }


def _check_pp2(family: str, schedule: str, tmp_path, compiled: bool = False) -> None:
    dist_testing = pytest.importorskip("plait.dist_core.testing")
    torch.manual_seed(0)
    full = _pp_model(family)
    full.reset_parameters()
    ckpt = save_hf_checkpoint(full, tmp_path / "seed")
    ids, labels = _batch()
    ref = full(input_ids=ids, labels=labels)
    ref["loss"].backward()
    results = dist_testing.run_distributed(_pp_rank, 2, str(ckpt), schedule, family, compiled, timeout=240.0)
    losses = [r["loss"] for r in results if r["loss"] is not None]
    assert losses == [pytest.approx(ref["loss"].item(), abs=1e-5)]
    grads = {**results[0]["grads"], **results[1]["grads"]}
    assert set(grads) == {n for n, _ in full.named_parameters()}
    for n, p in full.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, atol=1e-5, rtol=1e-4, msg=n)


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_pp2_matches_single_process(schedule, tmp_path):
    _check_pp2("qwen3_moe", schedule, tmp_path)


def test_pp2_with_compiled_layers_matches_single_process(tmp_path):
    """zbv splits each backward; a compiled MoE layer's backward (plait's ops inside) runs whole at the
    input pass, and the gradients still equal the single-process eager model's."""
    _check_pp2("qwen3_moe", "zbv", tmp_path, compiled=True)


@pytest.mark.parametrize("schedule", sorted(FAMILY_SCHEDULES))
@pytest.mark.parametrize("family", sorted(SMALL))
def test_family_pp2_matches_single_process(family, schedule, tmp_path):
    _check_pp2(family, schedule, tmp_path)
