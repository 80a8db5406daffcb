"""plait Qwen3 / Qwen3-MoE against real transformers: logits, export round trip, checkpoint diff."""

from __future__ import annotations

import pytest
import torch
import transformers
from plait.models import from_pretrained, load_hf_config, save_hf_checkpoint
from plait.models.qwen3 import Qwen3ForCausalLM, Qwen3MoeConfig
from safetensors import safe_open

from ._hf_utils import make_hf

CASES = {
    "dense": ("dense", {}),
    "dense_tied": ("dense", {"tie_word_embeddings": True}),
    "dense_bias_yarn": (
        "dense",
        {
            "attention_bias": True,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 5000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
    ),
    "moe_norm_topk": ("moe", {"norm_topk_prob": True}),
    "moe_no_norm_mixed": ("moe", {"norm_topk_prob": False, "mlp_only_layers": [1]}),
    "moe_sparse_step_tied": (
        "moe",
        {"decoder_sparse_step": 2, "tie_word_embeddings": True, "norm_topk_prob": True},
    ),
}


def _ids(vocab: int = 128, b: int = 2, s: int = 12) -> torch.Tensor:
    return torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("case", sorted(CASES))
def test_parity_and_round_trip(case, tmp_path):
    """Logits and loss equal transformers'; config maps field by field; the export reloads in
    transformers with identical logits and byte-identical tensors under the original keys."""
    kind, overrides = CASES[case]
    path, hf = make_hf(kind, tmp_path, **overrides)
    model = from_pretrained(path)
    ids = _ids()
    with torch.no_grad():
        ref = hf(ids).logits
        out = model(input_ids=ids)["logits"]
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)

    labels = torch.roll(ids, -1, dims=1)
    labels[:, -1] = -100
    with torch.no_grad():
        res = model(input_ids=ids, labels=labels)
    ref_loss = torch.nn.functional.cross_entropy(ref.flatten(0, 1), labels.flatten(), ignore_index=-100)
    torch.testing.assert_close(res["loss"], ref_loss, atol=1e-5, rtol=1e-5)
    assert int(res["num_tokens"]) == 2 * 11

    cfg = load_hf_config(path)
    assert cfg.model_type == hf.config.model_type
    assert cfg.tie_word_embeddings == hf.config.tie_word_embeddings
    if isinstance(cfg, Qwen3MoeConfig):
        assert cfg.num_experts == hf.config.num_experts
        for i in range(cfg.num_hidden_layers):
            hf_sparse = type(hf.model.layers[i].mlp).__name__.endswith("SparseMoeBlock")
            assert cfg.is_moe_layer(i) == hf_sparse, i

    exported = save_hf_checkpoint(model, tmp_path / "export")
    reloaded = type(hf).from_pretrained(exported).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, ref, atol=0, rtol=0)
    with (
        safe_open(str(path / "model.safetensors"), "pt") as a,
        safe_open(str(exported / "model.safetensors"), "pt") as b,
    ):
        assert set(a.keys()) == set(b.keys())
        for k in a.keys():  # noqa: SIM118 (safe_open has no __iter__)
            assert torch.equal(a.get_tensor(k), b.get_tensor(k)), k


def test_model_state_diff_empty(tmp_path, capsys):
    """``python -m plait.model_state diff`` (its ``main``, run in-process) finds no difference."""
    from plait.model_state.cli import main

    path, _ = make_hf("moe", tmp_path, norm_topk_prob=True, mlp_only_layers=[0])
    model = from_pretrained(path)
    out = save_hf_checkpoint(model, tmp_path / "export")
    assert main(["diff", str(path), str(out)]) == 0
    assert capsys.readouterr().out.strip().endswith("SAME")
    # ...and the check can fail: a perturbed expert shows up.
    with torch.no_grad():
        model.model.layers["1"].mlp.experts.down_proj[2, 0, 0] += 1.0
    bad = save_hf_checkpoint(model, tmp_path / "bad")
    assert main(["diff", str(path), str(bad)]) == 1
    assert "model.layers.1.mlp.experts.2.down_proj.weight" in capsys.readouterr().out


def test_fused_expert_layout_loads(tmp_path):
    """transformers 5.x's in-memory fused expert tensors (gate_up_proj / down_proj) load too."""
    path, hf = make_hf("moe", tmp_path, norm_topk_prob=True)
    model = from_pretrained(path)
    fused = save_hf_checkpoint(model, tmp_path / "fused", fused_experts=True)
    with safe_open(str(fused / "model.safetensors"), "pt") as f:
        assert "model.layers.0.mlp.experts.gate_up_proj" in set(f.keys())
    again = from_pretrained(fused)
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=ids)["logits"], hf(ids).logits, atol=1e-5, rtol=0)


def test_meta_build_and_reset_parameters():
    from ._hf_utils import MOE

    cfg = Qwen3MoeConfig(**{**MOE, "tie_word_embeddings": True})
    with torch.device("meta"):
        model = Qwen3ForCausalLM(cfg)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.reset_parameters()
    for name, p in model.named_parameters():
        assert torch.isfinite(p).all(), name
        if name.endswith("norm.weight"):
            assert torch.equal(p, torch.ones_like(p)), name
        else:
            assert 0.01 < p.std().item() < 0.03, name  # normal(0, initializer_range=0.02)
    assert model.lm_head is not None and model.lm_head.weight is model.model.embed_tokens.weight


def test_sequence_classification_matches_transformers():
    """Last non-padding token pooling (found from pad_token_id like HF) + score head."""
    from plait.models import config_from_hf
    from plait.models.qwen3 import Qwen3ForSequenceClassification

    from ._hf_utils import BASE

    torch.manual_seed(0)
    hf_cfg = transformers.Qwen3Config(**BASE, num_labels=3, pad_token_id=0)
    hf = transformers.Qwen3ForSequenceClassification(hf_cfg).eval()
    model = Qwen3ForSequenceClassification(config_from_hf(hf_cfg.to_dict()), num_labels=3)
    model.load_state_dict(hf.state_dict())
    ids = _ids().clamp(min=1)
    ids[0, 9:] = 0  # right padding in row 0
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids)["logits"], hf(ids).logits, atol=1e-5, rtol=0)
        # Left padding with an attention_mask: attention skips the padding in both.
        ids, mask = _padded_batch("left")
        ids = torch.where(mask == 1, ids.clamp(min=1), 0)
        out = model(input_ids=ids, attention_mask=mask)["logits"]
        torch.testing.assert_close(out, hf(ids, attention_mask=mask).logits, atol=1e-5, rtol=0)


# --- padded batches (transformers' attention_mask) and the MoE aux loss -------------------------


def _padded_batch(side: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and a padding mask with rows of 12, 9 and 5 real tokens padded on ``side``."""
    ids = _ids(b=3, s=12)
    mask = torch.zeros(3, 12, dtype=torch.long)
    for row, n in enumerate((12, 9, 5)):
        if side == "left":
            mask[row, 12 - n :] = 1
        else:
            mask[row, :n] = 1
    return ids.masked_fill(mask == 0, 0), mask


def _labels(ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(plait's aligned labels, transformers' unshifted labels) that score the same positions.

    plait's labels are next tokens everywhere except where the next token is padding; the labels of
    padding positions are real-looking tokens on purpose: the attention mask must leave them out.
    transformers' labels are -100 wherever plait's position is padding or its target is.
    """
    plait = torch.roll(ids, -1, dims=1)
    plait[:, :-1] = plait[:, :-1].masked_fill(mask[:, 1:] == 0, -100)
    plait[:, -1] = -100
    scored = (mask == 1) & (plait != -100)
    hf = torch.full_like(ids, -100)
    hf[:, 1:] = ids[:, 1:].masked_fill(~scored[:, :-1], -100)
    return plait, hf


PADDED = {
    "dense_left": ("dense", "left", False),
    "dense_right": ("dense", "right", False),
    "dense_left_position_ids": ("dense", "left", True),
    "moe_left": ("moe", "left", False),
    "moe_right_position_ids": ("moe", "right", True),
}


@pytest.mark.parametrize("attn", ["sdpa", "flex"])
@pytest.mark.parametrize("case", sorted(PADDED))
def test_padded_batch_matches_transformers(case, attn, tmp_path):
    """With transformers' attention_mask (and optionally its generate-style position_ids) the logits
    of real tokens and the loss equal transformers' for the same padded batch; padding positions
    are not scored whatever their labels."""
    kind, side, with_positions = PADDED[case]
    path, hf = make_hf(kind, tmp_path, router_aux_loss_coef=0.0)
    model = from_pretrained(path, attn_implementation=attn)
    ids, mask = _padded_batch(side)
    kw = {}
    if with_positions:
        kw["position_ids"] = (mask.cumsum(1) - 1).masked_fill(mask == 0, 1)
    plait_labels, hf_labels = _labels(ids, mask)
    with torch.no_grad():
        ref = hf(ids, attention_mask=mask, labels=hf_labels, **kw)
        logits = model(input_ids=ids, attention_mask=mask, **kw)["logits"]
        out = model(input_ids=ids, attention_mask=mask, labels=plait_labels, **kw)
    real = mask.bool()
    torch.testing.assert_close(logits[real], ref.logits[real], atol=1e-5, rtol=0)
    torch.testing.assert_close(out["loss"], ref.loss, atol=1e-5, rtol=1e-5)
    assert int(out["num_tokens"]) == int((hf_labels != -100).sum())


@pytest.mark.parametrize("attn", ["sdpa", "flex"])
def test_padding_composes_with_packed_documents(attn, tmp_path):
    """A row of two packed documents and right padding: each document's logits equal
    transformers' on that document alone (document masking from position_ids or document_ids)."""
    path, hf = make_hf("moe", tmp_path, router_aux_loss_coef=0.0)
    model = from_pretrained(path, attn_implementation=attn)
    ids = _ids(b=2, s=12)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[0, 9:] = 0
    pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 0, 0], list(range(12))])
    docs = torch.tensor([[0] * 5 + [1] * 4 + [2] * 3, [0] * 12])
    with torch.no_grad():
        by_pos = model(input_ids=ids, attention_mask=mask, position_ids=pos)["logits"]
        by_docs = model(input_ids=ids, attention_mask=mask, document_ids=docs)["logits"]
        first, second, whole = hf(ids[:1, :5]).logits, hf(ids[:1, 5:9]).logits, hf(ids[1:]).logits
    for out in (by_pos, by_docs):
        torch.testing.assert_close(out[0, :5], first[0], atol=1e-5, rtol=0)
        torch.testing.assert_close(out[1], whole[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(by_pos[0, 5:9], second[0], atol=1e-5, rtol=0)


def _hf_moe_grads(hf, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    hf.zero_grad()
    loss.backward()
    return {
        n.replace("mlp.gate.weight", "mlp.router.weight"): p.grad.clone()
        for n, p in hf.named_parameters()
        if n.endswith("mlp.gate.weight")
    }


@pytest.mark.parametrize("padded", [False, True])
def test_moe_total_loss_matches_transformers(padded, tmp_path):
    """3 MoE layers, top-2, router_aux_loss_coef=0.05: plait's loss + aux_loss is transformers'
    total loss (load_balancing_loss_func pools all layers; padding left out through attention_mask),
    and the router gradients agree. ``router_aux_loss_pooling="per_layer"`` is the sum of
    transformers' loss of each layer alone."""
    from plait.models import config_from_hf, config_to_hf
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    coef = 0.05
    path, hf = make_hf("moe", tmp_path, router_aux_loss_coef=coef, norm_topk_prob=True)
    hf.train()  # only the aux loss' gradients are compared; there is no dropout
    model = from_pretrained(path)
    assert load_hf_config(path).router_aux_loss_pooling == "all_layers"
    ids, mask = _padded_batch("left")
    if not padded:
        mask = torch.ones_like(mask)
    plait_labels, hf_labels = _labels(ids, mask)
    ref = hf(ids, attention_mask=mask, labels=hf_labels, output_router_logits=True)
    ref_grads = _hf_moe_grads(hf, ref.loss)
    out = model(input_ids=ids, attention_mask=mask, labels=plait_labels)
    total = out["loss"] + out["aux_loss"]
    total.backward()
    torch.testing.assert_close(out["aux_loss"], coef * ref.aux_loss, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(total, ref.loss, atol=1e-5, rtol=1e-5)
    for name, p in model.named_parameters():
        if name in ref_grads:
            torch.testing.assert_close(p.grad, ref_grads[name], atol=1e-5, rtol=1e-4, msg=name)
    assert len(ref_grads) == 3

    per_layer_cfg = config_from_hf(hf.config).model_copy(update={"router_aux_loss_pooling": "per_layer"})
    assert "router_aux_loss_pooling" not in config_to_hf(per_layer_cfg)  # plait-only, never in config.json
    per_layer = Qwen3ForCausalLM(per_layer_cfg)
    per_layer.load_state_dict(model.state_dict())
    got = per_layer(input_ids=ids, attention_mask=mask, labels=plait_labels)["aux_loss"]
    hf_mask = mask if padded else None
    per_layer_ref = sum(
        load_balancing_loss_func((logits,), hf.config.num_experts, hf.config.num_experts_per_tok, hf_mask)
        for logits in ref.router_logits
    )
    torch.testing.assert_close(got, coef * per_layer_ref, atol=1e-6, rtol=1e-5)
    print(
        f"\n[padded={padded}] transformers aux {ref.aux_loss.item():.4f} total {ref.loss.item():.4f} | "
        f"plait all_layers aux {out['aux_loss'].item() / coef:.4f} total {total.item():.4f} | "
        f"plait per_layer aux {got.item() / coef:.4f} total {(out['loss'] + got).item():.4f}"
    )
