"""Every family against transformers: logits, loss and every weight gradient; the export loads in
transformers with the same logits and the same bytes; bad configs name the key."""

from __future__ import annotations

import pytest
import torch
from plait.model_state.cli import main as model_state_cli
from plait.models import (
    config_from_hf,
    from_pretrained,
    load_hf_config,
    plait_to_hf_mapper,
    save_hf_checkpoint,
    supported_model_types,
)

from ._families import CASES, make_hf


def _batch(vocab: int = 97, b: int = 2, s: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (b, s), generator=g)
    labels = torch.roll(ids, -1, dims=1)
    labels[:, -1] = -100
    labels[0, :2] = -100
    return ids, labels


@pytest.mark.parametrize("case", sorted(CASES))
def test_parity_gradients_and_round_trip(case, tmp_path, capsys):
    path, hf = make_hf(case, tmp_path)
    model = from_pretrained(path)
    assert load_hf_config(path).model_type == hf.config.model_type
    ids, labels = _batch()

    ref = hf(ids)  # the cross-entropy of plait's (already shifted) labels, on HF's logits:
    ref_loss = torch.nn.functional.cross_entropy(
        ref.logits.flatten(0, 1), labels.flatten(), ignore_index=-100
    )
    ref_loss.backward()
    out = model(input_ids=ids, labels=labels, return_logits=True)
    out["loss"].backward()  # cross-entropy only on both sides (HF adds no router loss by default)
    torch.testing.assert_close(out["logits"], ref.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out["loss"], ref_loss, atol=1e-5, rtol=1e-5)

    grads = {k: p.grad for k, p in model.named_parameters() if p.grad is not None}
    hf_grads = plait_to_hf_mapper(model.config, fused_experts=True).map_state(grads)  # HF in-memory keys
    want = {k: p.grad for k, p in hf.named_parameters() if p.grad is not None}
    assert set(hf_grads) == set(want)
    for k, g in want.items():
        torch.testing.assert_close(hf_grads[k], g, atol=1e-5, rtol=1e-4, msg=k)

    exported = save_hf_checkpoint(model, tmp_path / "export")
    reloaded = type(hf).from_pretrained(exported).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, ref.logits, atol=0, rtol=0)
    assert model_state_cli(["diff", str(path), str(exported)]) == 0
    assert capsys.readouterr().out.strip().endswith("SAME")


def test_unsupported_model_type_and_options_name_the_key(tmp_path):
    with pytest.raises(ValueError, match=r"model_type must be one of .*'gpt_oss'.*'llama'.*got 'mistral'"):
        config_from_hf({"model_type": "mistral"})
    assert {"llama", "gpt_oss", "qwen3", "qwen3_moe"} <= set(supported_model_types())
    with pytest.raises(ValueError, match="longrope"):
        config_from_hf({"model_type": "llama", "rope_scaling": {"rope_type": "longrope", "factor": 2.0}})
    with pytest.raises(ValueError, match="low_freq_factor"):
        config_from_hf({"model_type": "llama", "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                        "original_max_position_embeddings": 64}})  # fmt: skip
    with pytest.raises(ValueError, match="mxfp4"):
        config_from_hf({"model_type": "gpt_oss", "quantization_config": {"quant_method": "mxfp4"}})
    with pytest.raises(ValueError, match="num_foo_heads"):
        config_from_hf({"model_type": "llama", "num_foo_heads": 3})
    with pytest.raises(ValueError, match="rms_norm_eps"):
        config_from_hf({"model_type": "llama", "rms_norm_eps": float("nan")})
    with pytest.raises(ValueError, match="layer_types has 2 entries"):
        config_from_hf(
            {"model_type": "gpt_oss", "num_hidden_layers": 3, "layer_types": ["full_attention"] * 2}
        )


def test_wrong_tensor_shape_names_tensor_and_shapes(tmp_path):
    path, _ = make_hf("llama", tmp_path)
    cfg = load_hf_config(path)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(
        (path / "config.json").read_text().replace('"intermediate_size": 50', '"intermediate_size": 52')
    )
    for f in path.glob("*.safetensors"):
        (bad / f.name).write_bytes(f.read_bytes())
    assert cfg.intermediate_size == 50
    with pytest.raises(Exception, match=r"model\.layers\.0\.mlp\.(gate|up|down)_proj\.weight.*50.*52|52.*50"):
        from_pretrained(bad)


@pytest.mark.parametrize("field", ["hidden_size", "num_experts", "num_hidden_layers"])
def test_from_pretrained_refuses_a_model_larger_than_memory_before_allocating(tmp_path, field):
    """config.json sizes far beyond the machine: refused in well under a second, naming the sizes,
    before any allocation (a million layers are counted one kind at a time)."""
    import json
    import time

    path, _ = make_hf("gpt_oss", tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("layer_types")
    cfg[{"num_experts": "num_local_experts"}.get(field, field)] = {"hidden_size": 10**7, "num_experts": 10**9,
                                                                   "num_hidden_layers": 10**6}[field]  # fmt: skip
    (path / "config.json").write_text(json.dumps(cfg))
    start = time.perf_counter()
    with pytest.raises(
        ValueError, match=rf"parameters: .* GiB in torch.float32 .* more than .* GiB of cpu.*{field}="
    ):
        from_pretrained(path)
    assert time.perf_counter() - start < 5.0


@pytest.mark.parametrize("mode", ["full", "selective"])
@pytest.mark.parametrize("case", ["llama", "gpt_oss"])
def test_activation_checkpointing_matches_no_checkpointing(case, mode, tmp_path):
    """Checkpointed layers (recomputed in backward: the attention runs twice) give the loss and every
    gradient of the plain model; MoE routers count each token once (not again when recomputed)."""
    from plait.models import ActivationCheckpointing, ParallelConfig, parallelize

    path, _ = make_hf(case, tmp_path)
    ids, labels = _batch()
    position_ids = torch.cat([torch.arange(5), torch.arange(7)]).expand(2, 12)  # two packed documents
    results = []
    for ac in ("none", mode):
        model = from_pretrained(path).train()
        parallelize(model, config=ParallelConfig(activation_checkpointing=ActivationCheckpointing(mode=ac)))
        calls: list[int] = []
        layer0 = next(model.decoder_layers())
        layer0.self_attn.register_forward_hook(lambda *_, calls=calls: calls.append(1))
        out = model(input_ids=ids, labels=labels, position_ids=position_ids)
        (out["loss"] + out.get("aux_loss", 0.0)).backward()
        assert len(calls) == (1 if ac == "none" else 2), ac
        counts = [moe.router._stat_counts.clone() for moe in model.moe_layers()]
        results.append((out["loss"].detach(), {n: p.grad for n, p in model.named_parameters()}, counts))
    (ref_loss, ref_grads, ref_counts), (loss, grads, counts) = results
    torch.testing.assert_close(loss, ref_loss, atol=0, rtol=0)
    assert set(grads) == set(ref_grads) and all(g is not None for g in grads.values())
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, atol=1e-6, rtol=1e-5, msg=name)
    assert len(counts) == (3 if case == "gpt_oss" else 0)
    for a, b in zip(counts, ref_counts, strict=True):
        assert torch.equal(a, b) and int(a.sum()) == ids.numel() * 2  # top-2 of each token, once


def test_selective_checkpointing_keeps_matmuls_and_grouped_gemms(tmp_path):
    """Per-op selective checkpointing recomputes the layer but not its matmuls or the experts' grouped
    GEMMs: the backward runs as many of them as without checkpointing (full checkpointing runs more)."""
    import collections

    from plait.models import ActivationCheckpointing, ParallelConfig, parallelize
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: collections.Counter[str] = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[str(func)] += 1
            return func(*args, **(kwargs or {}))

    path, _ = make_hf("gpt_oss", tmp_path)
    ids, labels = _batch()
    counts = {}
    for ac in ("none", "full", "selective"):
        model = from_pretrained(path).train()
        parallelize(model, config=ParallelConfig(activation_checkpointing=ActivationCheckpointing(mode=ac)))
        out = model(input_ids=ids, labels=labels)
        with Count() as c:
            (out["loss"] + out["aux_loss"]).backward()
        counts[ac] = c.ops
    for op in ("plait.gmm.default", "aten.addmm.default"):  # gpt-oss projections have biases
        assert counts["full"][op] > counts["none"][op], op
        assert counts["selective"][op] == counts["none"][op], op


def test_selective_checkpointing_keeps_attention_outputs_by_default():
    """The default ``save_ops`` keep every attention kernel's output, FlexAttention's included (packed
    documents take it on a GPU without flash-attn): it is a higher-order op, matched by the name torch gives
    it, not an aten overload. On an H200 keeping it made ``plait train`` 7-10% faster under selective
    checkpointing (``benchmarks/results/training.md``); torch has no FlexAttention backward on CPU, so this
    test checks the policy against torch's ops themselves."""
    from plait.models import ActivationCheckpointing
    from plait.models.common.parallel.activation_checkpointing import _policy
    from torch._higher_order_ops.flex_attention import flex_attention
    from torch.utils.checkpoint import CheckpointPolicy

    policy = _policy(frozenset(ActivationCheckpointing(mode="selective").save_ops))
    kept = [flex_attention, torch.ops.aten._scaled_dot_product_flash_attention.default,
            torch.ops.aten._scaled_dot_product_efficient_attention.default, torch.ops.aten.mm.default]  # fmt: skip
    for op in kept:
        assert policy(None, op) is CheckpointPolicy.MUST_SAVE, op
    assert policy(None, torch.ops.aten.silu.default) is CheckpointPolicy.PREFER_RECOMPUTE


@pytest.mark.parametrize(
    "mode,dtype,backend",
    [
        ("full", torch.bfloat16, "aot_eager"),
        ("selective", torch.bfloat16, "aot_eager"),
        ("full", torch.float32, "inductor"),
    ],
)
def test_checkpointed_moe_layers_compile_as_one_graph(mode, dtype, backend, tmp_path):
    """A checkpointed MoE decoder layer compiles with ``fullgraph=True`` (the layer records its MoE
    statistics outside the checkpointed block: an attribute set inside it made Dynamo break the graph
    and run the layer eagerly) and gives the uncompiled checkpointed layer's loss, gradients and
    recorded aux loss. Inductor in fp32: RMSNorm's weight-only ``+ 0.0`` made AOTAutograd's
    partitioner fail there."""
    from plait.models import ActivationCheckpointing, ParallelConfig, parallelize

    path, _ = make_hf("gpt_oss", tmp_path)
    ids, labels = _batch()
    results = []
    for compiled in (False, True):
        torch._dynamo.reset()
        model = from_pretrained(path).train().to(dtype)
        parallelize(model, config=ParallelConfig(activation_checkpointing=ActivationCheckpointing(mode=mode)))
        if compiled:
            for layer in model.decoder_layers():
                layer.compile(fullgraph=True, backend=backend)
        out = model(input_ids=ids, labels=labels)
        (out["loss"] + out["aux_loss"]).backward()
        recorded = [layer.last_aux_loss for layer in model.decoder_layers()]
        assert all(r is not None for r in recorded)
        results.append(
            (out["loss"].float(), {n: p.grad.float() for n, p in model.named_parameters()}, recorded)
        )
    (ref_loss, ref_grads, ref_aux), (loss, grads, aux) = results
    torch.testing.assert_close(loss, ref_loss, atol=2e-2, rtol=1e-2)
    for a, b in zip(aux, ref_aux, strict=True):
        torch.testing.assert_close(a.float(), b.float(), atol=1e-3, rtol=2e-2)
    for name, g in ref_grads.items():
        err = ((grads[name] - g).norm() / g.norm().clamp_min(1e-6)).item()
        assert err < 0.05, (name, err)
