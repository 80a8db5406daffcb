"""Qwen3.5 / Qwen3-Next against transformers (logits, loss, every gradient; export loads back),
the vision-language checkpoints, the gated delta rule against a float64 recurrence, packed documents
against separate runs, config errors, compile, the optional fla kernels, LoRA adapters read by peft."""

from __future__ import annotations

import logging

import pytest
import torch
import transformers
from plait.models import (
    config_from_hf,
    estimate_num_parameters,
    flops_per_token,
    from_pretrained,
    plait_to_hf_mapper,
    save_hf_checkpoint,
)
from plait.models.common.attention import build_attention_mask
from plait.models.common.linear_attention import (
    GatedDeltaNet,
    causal_conv1d,
    chunk_gated_delta_rule,
    recurrent_gated_delta_rule,
)
from plait.models.common.rope import RotaryEmbedding
from plait.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3NextConfig, qwen3_5_layer

from ._families import HYBRID_CASES, make_hf

SEQ = 13  # not a multiple of the chunk sizes below


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-12)).item()


def _batch(vocab: int = 97) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (2, SEQ), generator=g)
    labels = torch.roll(ids, -1, dims=1)
    labels[:, -1] = -100
    labels[0, :2] = -100
    return ids, labels


@pytest.mark.parametrize("case", sorted(HYBRID_CASES))
def test_parity_gradients_and_round_trip(case, tmp_path):
    """fp32: logits within 2e-6, every parameter gradient within 5e-5 relative (both sides run the
    recurrence in fp32: the logits ~1e-6 apart); plait with chunks of 5 tokens (transformers: 64)."""
    path, hf = make_hf(case, tmp_path)
    model = from_pretrained(path, linear_chunk_size=5)
    ids, labels = _batch()
    ref = hf(ids)
    ref_loss = torch.nn.functional.cross_entropy(
        ref.logits.flatten(0, 1), labels.flatten(), ignore_index=-100
    )
    ref_loss.backward()
    out = model(input_ids=ids, labels=labels, return_logits=True)
    out["loss"].backward()
    assert _rel(out["logits"], ref.logits) < 2e-6
    torch.testing.assert_close(out["loss"], ref_loss, atol=1e-5, rtol=1e-5)
    grads = {k: p.grad for k, p in model.named_parameters() if p.grad is not None}
    hf_grads = plait_to_hf_mapper(model.config, fused_experts=True).map_state(grads)
    want = {k: p.grad for k, p in hf.named_parameters() if p.grad is not None}
    assert set(hf_grads) == set(want)
    assert any(".linear_attn.A_log" in k for k in want) and any(".self_attn.q_norm" in k for k in want)
    for k, g in want.items():
        # the gradients sum over every token through the recurrence, in fp32 and in another order (chunks
        # of 5 against 64): 0.6-2.5e-5 apart depending on the CPU's vector width; a wrong formula is >1e-3
        assert _rel(hf_grads[k], g) < 5e-5, k

    exported = save_hf_checkpoint(model, tmp_path / "export")
    reloaded = type(hf).from_pretrained(exported).eval()
    want_state = hf.state_dict()
    for k, t in reloaded.state_dict().items():
        assert torch.equal(t, want_state[k]), k
    with torch.no_grad():  # same weights; transformers' loaded MoE may pick another expert kernel
        assert _rel(reloaded(ids).logits, ref.logits) < 1e-6
    assert estimate_num_parameters(model.config) == sum(p.numel() for p in model.parameters())


def test_vision_language_checkpoint_loads_its_language_model_and_exports_the_text_model(tmp_path, caplog):
    """A ``qwen3_5`` (vision-language) checkpoint: plait builds the language model (the vision
    tower skipped with one note) with transformers' text-only logits; the export loads in
    transformers as ``Qwen3_5ForCausalLM`` with the same logits."""
    _, _, text = HYBRID_CASES["qwen3_5_text"]
    vision = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=16, out_hidden_size=text["hidden_size"],
                  patch_size=2, temporal_patch_size=1, num_position_embeddings=16)  # fmt: skip
    cfg = transformers.Qwen3_5Config(text_config=text, vision_config=vision)
    torch.manual_seed(0)
    hf = transformers.Qwen3_5ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p)) if "norm" in name else p.normal_(0.0, 0.2)
    hf.save_pretrained(tmp_path / "vl")
    ids, _ = _batch()
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
    with caplog.at_level(logging.WARNING):
        model = from_pretrained(tmp_path / "vl")
    notes = [r.getMessage() for r in caplog.records if "vision tower" in r.getMessage()]
    assert len(notes) == 1 and "model.visual." in notes[0]
    assert model.config.model_type == "qwen3_5_text"
    with torch.no_grad():
        assert _rel(model(input_ids=ids)["logits"], ref) < 2e-6
    exported = save_hf_checkpoint(model, tmp_path / "export")
    text_lm = transformers.AutoModelForCausalLM.from_pretrained(exported).eval()
    assert type(text_lm).__name__ == "Qwen3_5ForCausalLM"
    with torch.no_grad():
        assert _rel(text_lm(ids).logits, ref) < 2e-6


def _rule_inputs(docs: bool):
    g = torch.Generator().manual_seed(0)
    b, s, hk, hv, dk, dv = 2, 11, 2, 4, 6, 5
    q, k = (torch.randn(b, s, hk, dk, generator=g) for _ in range(2))
    v = torch.randn(b, s, hv, dv, generator=g)
    decay = -torch.rand(b, s, hv, generator=g) * 2.0
    beta = torch.rand(b, s, hv, generator=g)
    ids = torch.tensor([[0] * 4 + [1] * 5 + [2] * 2, [0] * 9 + [1] * 2]) if docs else None
    return [t.requires_grad_() for t in (q, k, v, decay, beta)], ids


@pytest.mark.parametrize("docs", [False, True])
def test_chunked_delta_rule_matches_float64_recurrence(docs):
    """Forward and every input gradient of the fp32 chunked rule (chunks of 4 over 11 tokens,
    documents restarting inside chunks and at a chunk start) against the float64 recurrence."""
    (q, k, v, decay, beta), ids = _rule_inputs(docs)
    g_out = torch.randn(2, 11, 4, 5, generator=torch.Generator().manual_seed(1))
    outs = []
    for fn in (chunk_gated_delta_rule, recurrent_gated_delta_rule):
        kw = {"chunk_size": 4} if fn is chunk_gated_delta_rule else {}
        o = fn(q, k, v, decay, beta, document_ids=ids, **kw)
        grads = torch.autograd.grad((o.double() * g_out).sum(), [q, k, v, decay, beta])
        outs.append((o.double(), grads))
    (o, grads), (ref, ref_grads) = outs
    assert _rel(o, ref) < 1e-5
    for name, a, b in zip(["q", "k", "v", "g", "beta"], grads, ref_grads, strict=True):
        assert _rel(a, b) < 1e-5, name


def test_convolution_restarts_at_document_starts():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(1, 9, 3, generator=g), torch.randn(3, 4, generator=g)
    ids = torch.tensor([[0] * 5 + [1] * 4])
    packed = causal_conv1d(x, w, ids)
    separate = torch.cat([causal_conv1d(x[:, :5], w), causal_conv1d(x[:, 5:], w)], dim=1)
    torch.testing.assert_close(packed, separate, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(causal_conv1d(x, w, torch.zeros(1, 9, dtype=torch.long)), causal_conv1d(x, w))


def _small(**kw) -> Qwen3NextConfig:
    base = dict(HYBRID_CASES["qwen3_next"][2], linear_chunk_size=4, initializer_range=0.2, **kw)
    base.pop("rope_parameters")
    return Qwen3NextConfig(**base)


def test_packed_documents_equal_separate_runs():
    """One row of two packed documents (positions restart) = the two documents run alone: logits,
    the summed loss and every gradient; the recurrent and the convolution states restart."""
    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(_small(router_aux_loss_coef=0.0))
    model.reset_parameters()
    ids = torch.randint(0, 97, (1, 11), generator=torch.Generator().manual_seed(2))
    labels = torch.roll(ids, -1, dims=1)
    lens = (6, 5)
    labels[0, lens[0] - 1] = labels[0, -1] = -100
    pos = torch.cat([torch.arange(n) for n in lens]).unsqueeze(0)
    out = model(input_ids=ids, labels=labels, position_ids=pos, return_logits=True)
    out["loss_sum"].backward()
    packed = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    logits, total = [], 0.0
    for part_ids, part_labels in zip(ids.split(lens, 1), labels.split(lens, 1), strict=True):
        o = model(input_ids=part_ids, labels=part_labels, return_logits=True)
        o["loss_sum"].backward()
        logits.append(o["logits"])
        total += o["loss_sum"].item()
    assert _rel(out["logits"], torch.cat(logits, 1)) < 1e-5
    assert out["loss_sum"].item() == pytest.approx(total, rel=1e-5)
    for n, g in packed.items():  # fp32 sums in another order: up to ~1.1e-5 apart on some CPUs
        assert _rel(g, model.get_parameter(n).grad) < 3e-5, n


@pytest.mark.parametrize(
    "change,match",
    [
        ({"layer_types": ["linear_attention", "full_attention"]}, "layer_types has 2 entries"),
        ({"layer_types": ["linear_attention", "sliding_attention", "full_attention"]}, "layer_types"),
        ({"linear_num_value_heads": 3}, "linear_num_value_heads"),
        ({"num_key_value_heads": 4}, "num_key_value_heads"),
        ({"attn_output_gate": False}, "attn_output_gate"),
    ],
)
def test_bad_configs_name_the_key(change, match):
    for model_type in ("qwen3_5_text", "qwen3_next"):
        d = dict(HYBRID_CASES["qwen3_5_text"][2], model_type=model_type, **change)
        with pytest.raises(ValueError, match=match):
            config_from_hf(d)


def test_full_attention_interval_and_vision_language_config():
    cfg = config_from_hf({"model_type": "qwen3_next", "num_hidden_layers": 6, "full_attention_interval": 3})
    assert cfg.layer_types == ("linear_attention",) * 2 + ("full_attention",) + ("linear_attention",) * 2 + (
        "full_attention",
    )
    assert cfg.rope_parameters.partial_rotary_factor == 0.25
    vl = config_from_hf({"model_type": "qwen3_5_moe", "tie_word_embeddings": True,
                         "text_config": {"num_hidden_layers": 2, "rope_parameters": {
                             "rope_theta": 1e7, "mrope_section": [11, 11, 10], "mrope_interleaved": True}}})  # fmt: skip
    assert (vl.model_type, vl.tie_word_embeddings, vl.mrope_section) == (
        "qwen3_5_moe_text",
        True,
        (11, 11, 10),
    )
    assert flops_per_token(vl, 128) > 6 * vl.vocab_size * vl.hidden_size


def _layer_setup(kind: str):
    """A decoder layer of ``kind`` (Qwen3-Next's grouped projections, a dense MLP: the MoE block
    compiles in tests/models/test_compile.py) and its inputs: 2 rows of 8 tokens, two chunks of 4,
    the first row two packed documents."""
    torch.manual_seed(0)
    layer_types = ["linear_attention", "full_attention"]
    cfg = _small(num_hidden_layers=2, layer_types=layer_types, mlp_only_layers=[0, 1])
    layer = qwen3_5_layer(cfg, layer_types.index(kind))
    layer.reset_parameters(0.2)
    b, s = 2, 8
    docs = torch.tensor([[0] * 3 + [1] * 5, [0] * s])
    rope = RotaryEmbedding(cfg.rope_parameters, cfg.resolved_head_dim, 64)(
        torch.arange(s).expand(b, s), torch.float32
    )
    mask = build_attention_mask(
        b, s, torch.device("cpu"), torch.float32, document_ids=docs, implementation="sdpa"
    )
    return layer, torch.randn(b, s, cfg.hidden_size), rope, mask


@pytest.mark.parametrize("kind", ["linear_attention", "full_attention"])
def test_decoder_layer_compiles_fullgraph(kind):
    """A decoder layer of each kind (packed documents) compiles with ``fullgraph=True`` and gives
    eager's output and gradients."""
    from torch._dynamo.utils import counters

    layer, x, rope, mask = _layer_setup(kind)
    results = []
    for compiled in (False, True):
        torch._dynamo.reset()
        counters.clear()
        fn = torch.compile(layer, fullgraph=True, backend="aot_eager") if compiled else layer
        layer.zero_grad()
        xx = x.clone().requires_grad_()
        h, aux, _ = fn(xx, rope, mask)
        (h.square().mean() + (aux if aux is not None else 0.0)).backward()
        assert not counters["graph_break"]
        results.append((h.detach(), xx.grad, {n: p.grad.clone() for n, p in layer.named_parameters()}))
    (h0, dx0, g0), (h1, dx1, g1) = results
    torch.testing.assert_close(h1, h0, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dx1, dx0, atol=1e-5, rtol=1e-5)
    for n, g in g0.items():
        torch.testing.assert_close(g1[n], g, atol=1e-5, rtol=1e-4, msg=n)


def test_fla_is_refused_where_it_cannot_train_and_never_used_on_cpu(monkeypatch):
    """``fla``: refused naming why where fla cannot train; ``auto``: the PyTorch path there; a usable fla
    is imported when the layer is built (not in a compiled forward); a CPU-only machine never uses it."""
    from plait.models.common.linear_attention import gated_deltanet
    from plait.models.common.linear_attention.fla import FlaKernels, fla_unusable

    kernels = FlaKernels(causal_conv1d=print, chunk_gated_delta_rule=print)
    assert GatedDeltaNet(8, 1, 2, 4, 4, 3, implementation="fla").fla is None  # no CUDA here
    monkeypatch.setattr(gated_deltanet.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gated_deltanet, "fla_unusable", lambda: "fla-core is not installed (pip install x)")
    with pytest.raises(ImportError, match=r"linear_attn_implementation='fla': fla-core is not installed"):
        GatedDeltaNet(8, 1, 2, 4, 4, 3, implementation="fla")
    assert GatedDeltaNet(8, 1, 2, 4, 4, 3, implementation="auto").fla is None
    monkeypatch.setattr(gated_deltanet, "fla_unusable", lambda: None)
    monkeypatch.setattr(gated_deltanet, "fla_kernels", lambda: kernels)
    assert GatedDeltaNet(8, 1, 2, 4, 4, 3, implementation="auto").fla is kernels
    assert GatedDeltaNet(8, 1, 2, 4, 4, 3, implementation="torch").fla is None
    # fla's own guard: Hopper with Triton in [3.4, 3.7.1) and no tilelang
    import importlib.metadata
    import importlib.util

    monkeypatch.undo()

    def versions(triton: str, tilelang: str | None = None):  # type: ignore[no-untyped-def]
        def version(name: str) -> str:
            found = {"triton": triton, "tilelang": tilelang}.get(name)
            if found is None:
                raise importlib.metadata.PackageNotFoundError(name)
            return found

        return version

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())  # fla installed
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(importlib.metadata, "version", versions("3.6.0"))
    assert "Triton 3.6.0" in (fla_unusable() or "")
    monkeypatch.setattr(importlib.metadata, "version", versions("3.6.0", tilelang="0.1"))
    assert fla_unusable() is None
    monkeypatch.setattr(importlib.metadata, "version", versions("3.7.1"))
    assert fla_unusable() is None


@pytest.mark.gpu
@pytest.mark.parametrize("docs", [False, True])
def test_fla_kernels_match_the_float64_reference_on_cuda(docs):
    """fla-core's convolution and chunked gated delta rule (bf16 inputs) against the float64
    references: forward and every input gradient."""
    pytest.importorskip("fla", reason="needs fla-core (pip install 'plait-models[fla]')")
    from plait.models.common.linear_attention.fla import (
        fla_causal_conv1d,
        fla_gated_delta_rule,
        fla_kernels,
        fla_unusable,
    )

    if (reason := fla_unusable()) is not None:
        pytest.skip(reason)
    kernels = fla_kernels()

    (q, k, v, decay, beta), ids = _rule_inputs(docs)
    ids = None if ids is None else ids.cuda()
    inputs = [t.detach().cuda().requires_grad_() for t in (q, k, v, decay, beta)]
    g_out = torch.randn(2, 11, 4, 5, device="cuda")
    o = fla_gated_delta_rule(
        *(t.bfloat16() if i < 3 else t for i, t in enumerate(inputs)), document_ids=ids, kernels=kernels
    )
    grads = torch.autograd.grad((o.float() * g_out).sum(), inputs)
    ref = recurrent_gated_delta_rule(*inputs, document_ids=ids)
    ref_grads = torch.autograd.grad((ref.float() * g_out).sum(), inputs)
    assert _rel(o, ref) < 2e-2
    for name, a, b in zip(["q", "k", "v", "g", "beta"], grads, ref_grads, strict=True):
        assert _rel(a, b) < 3e-2, name
    x = torch.randn(2, 11, 12, device="cuda", requires_grad=True)
    w = torch.randn(12, 4, device="cuda", requires_grad=True)
    got = fla_causal_conv1d(x, w, ids, kernels=kernels)
    want = torch.nn.functional.silu(causal_conv1d(x.double(), w.double(), ids))
    assert _rel(got, want) < 1e-4
    for a, b in zip(
        torch.autograd.grad(got.sum(), [x, w]), torch.autograd.grad(want.sum(), [x, w]), strict=True
    ):
        assert _rel(a, b) < 1e-4


def test_lora_on_every_mixer_projection_exports_to_peft_and_back(tmp_path):
    """plait LoRA on the gated DeltaNet projections (``in_proj_qkv/z/b/a``, ``out_proj``) and the
    gated attention's q/k/v/o -> a Hugging Face PEFT adapter (``hf_module_names``: transformers'
    ``linear_attn`` names) -> ``peft`` on transformers' model gives plait's logits; and back."""
    peft = pytest.importorskip("peft")
    from plait.models import hf_module_names
    from plait.peft import LoRAConfig, apply_peft
    from plait.peft.hf import export_hf_adapter, import_hf_adapter

    path, hf = make_hf("qwen3_5_text", tmp_path)
    ids, _ = _batch()
    model = from_pretrained(path).eval()
    with torch.no_grad():
        base = model(input_ids=ids)["logits"]
    targets = r"model\.layers\.\d+\.self_attn\.(in_proj_\w+|out_proj|[qkvo]_proj)"
    report = apply_peft(model, LoRAConfig(r=2, alpha=4, target_modules=targets, init="random"))
    assert report is not None and len(report.adapted) == 2 * 5 + 4, report.adapted
    with torch.no_grad():
        ours = model(input_ids=ids)["logits"]
    assert _rel(ours, base) > 1e-3, "the adapter must change the logits"
    to_hf, to_plait = hf_module_names(model.config)
    export_hf_adapter(model, tmp_path / "adapter", name_map=to_hf, task_type="CAUSAL_LM")
    theirs = peft.PeftModel.from_pretrained(type(hf).from_pretrained(path), str(tmp_path / "adapter")).eval()
    assert any(".linear_attn.in_proj_qkv.lora_A" in n for n, _ in theirs.named_parameters())
    with torch.no_grad():
        assert _rel(theirs(ids).logits, ours) < 2e-6
    back = from_pretrained(path).eval()
    import_hf_adapter(back, tmp_path / "adapter", name_map=to_plait)
    with torch.no_grad():
        assert _rel(back(input_ids=ids)["logits"], ours) < 1e-6
