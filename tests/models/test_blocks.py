"""Blocks against independent references: HF RoPE tables, per-document attention, pooling, config IO."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers
from plait.models import (
    RopeParameters,
    apply_rotary,
    build_attention_mask,
    config_from_hf,
    config_to_hf,
    document_ids_from_position_ids,
    pool_hidden_states,
    rope_inv_freq,
)
from plait.models.common.attention import attention
from plait.models.qwen3 import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

ROPES = [
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    {"rope_type": "yarn", "rope_theta": 1e6, "factor": 8.0, "original_max_position_embeddings": 32},
    {
        "rope_type": "yarn",
        "rope_theta": 5e5,
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "beta_fast": 16,
        "beta_slow": 2,
        "mscale": 1.0,
        "mscale_all_dim": 0.5,
        "partial_rotary_factor": 0.5,
    },
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0, "partial_rotary_factor": 0.25},
]


@pytest.mark.parametrize(
    "params", ROPES, ids=lambda p: f"{p['rope_type']}-{p.get('partial_rotary_factor', 1)}"
)
@pytest.mark.parametrize("seq_len", [None, 300])
def test_rope_inv_freq_matches_transformers(params, seq_len):
    hf_cfg = transformers.Qwen3Config(
        hidden_size=64,
        num_attention_heads=4,
        head_dim=32,
        max_position_embeddings=128,
        rope_parameters=dict(params),
    )
    ref, ref_scale = ROPE_INIT_FUNCTIONS[params["rope_type"]](hf_cfg, "cpu", seq_len=seq_len)
    ours, scale = rope_inv_freq(RopeParameters(**params), 32, 128, seq_len=seq_len)
    torch.testing.assert_close(ours, ref, atol=0, rtol=1e-6)
    assert scale == pytest.approx(ref_scale)


def test_partial_rotary_rotates_only_leading_dims():
    params = RopeParameters(rope_theta=100.0, partial_rotary_factor=0.5)
    inv, _ = rope_inv_freq(params, head_dim=8, max_position_embeddings=64)
    pos = torch.arange(5, dtype=torch.float64)
    q = torch.randn(1, 5, 2, 8, dtype=torch.float64)
    freqs = pos[:, None] * inv.double()
    cos, sin = torch.cat([freqs.cos()] * 2, -1)[None], torch.cat([freqs.sin()] * 2, -1)[None]
    out, _ = apply_rotary(q, q, cos, sin)
    # Reference: rotate each (i, i + rot/2) pair of the first 4 dims by angle pos * inv[i].
    ref = q.clone()
    for i in range(2):
        a, b = q[..., i], q[..., i + 2]
        ang = (pos[:, None] * inv[i].double())[None]
        ref[..., i] = a * ang.cos() - b * ang.sin()
        ref[..., i + 2] = b * ang.cos() + a * ang.sin()
    torch.testing.assert_close(out, ref)
    assert torch.equal(out[..., 4:], q[..., 4:])


def test_document_ids_from_position_ids():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]])
    assert document_ids_from_position_ids(pos).tolist() == [[1, 1, 1, 2, 2, 3], [1, 1, 1, 1, 1, 1]]


def _reference_attention(q, k, v, docs, scale):
    """float64 softmax attention with an explicit causal + same-document mask (GQA by repetition)."""
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    n = q.shape[1]
    mask = torch.ones(n, n, dtype=torch.bool).tril() & (docs[:, :, None] == docs[:, None, :])[:, None]
    s = s.masked_fill(~mask, float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v)


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_document_masked_attention(backend):
    torch.manual_seed(0)
    b, s, h, kv, d = 2, 16, 4, 2, 8
    q, k, v = torch.randn(b, s, h, d), torch.randn(b, s, kv, d), torch.randn(b, s, kv, d)
    docs = torch.tensor([[0] * 5 + [1] * 7 + [2] * 4, [0] * 16])
    mask = build_attention_mask(b, s, q.device, q.dtype, document_ids=docs, implementation=backend)
    out = attention(q, k, v, mask, d**-0.5)
    ref = _reference_attention(q.double(), k.double(), v.double(), docs, d**-0.5)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_static_captures_keep_each_mask_at_one_address():
    """With CUDA graphs the masks' tensors must keep their addresses across forwards (a compiled layer takes
    some as static inputs): each new mask is copied into the last one's buffers, and attends as it should."""
    from plait.models.common.attention.kernels import AttentionKernels

    torch.manual_seed(0)
    b, s, h, kv, d = 2, 16, 4, 2, 8
    q, k, v = torch.randn(b, s, h, d), torch.randn(b, s, kv, d), torch.randn(b, s, kv, d)
    kernels = AttentionKernels()
    kernels.static_captures = True

    def tensors(mask):
        return {n: t for n, t in vars(mask.block_mask).items() if isinstance(t, torch.Tensor)}

    addresses = None
    for docs in (torch.tensor([[0] * 5 + [1] * 11, [0] * 16]), torch.tensor([[0] * 16, [0] * 9 + [1] * 7])):
        mask = build_attention_mask(
            b, s, q.device, q.dtype, document_ids=docs, kernels=kernels, implementation="flex"
        )
        fresh = build_attention_mask(b, s, q.device, q.dtype, document_ids=docs, implementation="flex")
        assert tensors(mask).keys() == tensors(fresh).keys()
        for name, t in tensors(mask).items():
            torch.testing.assert_close(t, tensors(fresh)[name], msg=name)
        if addresses is None:
            addresses = {n: t.data_ptr() for n, t in tensors(mask).items()}
        assert {n: t.data_ptr() for n, t in tensors(mask).items()} == addresses
        out = attention(q, k, v, mask, d**-0.5)
        ref = _reference_attention(q.double(), k.double(), v.double(), docs, d**-0.5)
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_padding_masked_attention(backend):
    """Padding (left, right, inside packed rows) is never attended to; real queries match a float64
    reference over the real tokens, padding queries attend only to themselves."""
    torch.manual_seed(1)
    b, s, h, kv, d = 3, 12, 4, 2, 8
    q, k, v = torch.randn(b, s, h, d), torch.randn(b, s, kv, d), torch.randn(b, s, kv, d)
    docs = torch.tensor([[0] * 12, [0] * 12, [0] * 4 + [1] * 5 + [2] * 3])
    pad = torch.ones(b, s, dtype=torch.long)
    pad[0, :3] = 0  # left
    pad[1, 8:] = 0  # right
    pad[2, 9:] = 0  # right, after two packed documents
    mask = build_attention_mask(
        b, s, q.device, q.dtype, document_ids=docs, attention_mask=pad, implementation=backend
    )
    assert torch.equal(mask.padding_mask, pad.bool())
    out = attention(q, k, v, mask, d**-0.5)
    for row in range(b):
        real = pad[row].bool()
        sub = [t[row : row + 1, real].double() for t in (q, k, v)]
        ref = _reference_attention(*sub, docs[row : row + 1, real], d**-0.5)
        torch.testing.assert_close(out[row, real].double(), ref[0], atol=1e-5, rtol=1e-5)
        rep = h // kv
        torch.testing.assert_close(out[row, ~real], v[row, ~real].repeat_interleave(rep, 1))
    # No padding: the plain causal path, no mask tensors.
    plain = build_attention_mask(
        b, s, q.device, q.dtype, attention_mask=torch.ones(b, s), implementation="sdpa"
    )
    assert plain.dense_mask is None and plain.padding_mask is None
    with pytest.raises(ValueError, match="attention_mask"):
        build_attention_mask(b, s, q.device, q.dtype, attention_mask=pad[:, :5])


def test_packed_sequences_equal_separate_forwards():
    cfg = Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, initializer_range=0.2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg)
    model.reset_parameters()
    ids = torch.randint(0, 64, (1, 11))
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3]])
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=pos)["logits"]
        parts = [model(input_ids=ids[:, a:b])["logits"] for a, b in ((0, 4), (4, 7), (7, 11))]
    torch.testing.assert_close(packed, torch.cat(parts, 1), atol=1e-5, rtol=1e-5)


def test_pooling():
    h = torch.arange(24, dtype=torch.float32).view(2, 3, 4)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    torch.testing.assert_close(
        pool_hidden_states(h, "last", attention_mask=mask), torch.stack([h[0, 1], h[1, 2]])
    )
    torch.testing.assert_close(
        pool_hidden_states(h, "mean", attention_mask=mask), torch.stack([h[0, :2].mean(0), h[1].mean(0)])
    )
    torch.testing.assert_close(pool_hidden_states(h, "last"), h[:, -1])
    with pytest.raises(ValueError, match="pooling method"):
        pool_hidden_states(h, "max")  # type: ignore[arg-type]


def test_loss_without_logits_equals_cross_entropy():
    cfg = Qwen3Config(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4
    )
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg)
    model.reset_parameters()
    ids = torch.randint(0, 96, (2, 6))
    labels = torch.randint(0, 96, (2, 6))
    labels[0, 0] = -100
    out = model(input_ids=ids, labels=labels, return_logits=True)
    ref = F.cross_entropy(out["logits"].flatten(0, 1).double(), labels.flatten(), reduction="sum")
    torch.testing.assert_close(out["loss_sum"].double(), ref, atol=1e-4, rtol=1e-5)
    assert int(out["num_tokens"]) == 11


def test_config_from_hf_legacy_and_errors():
    legacy = {
        "model_type": "qwen3_moe", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100, "rope_theta": 1e6,
        "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096},
        "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "mlp_only_layers": None,
        "torch_dtype": "bfloat16", "use_cache": True,
    }  # fmt: skip
    cfg = config_from_hf(legacy)
    assert isinstance(cfg, Qwen3MoeConfig)
    assert cfg.rope_parameters.rope_type == "yarn" and cfg.rope_parameters.rope_theta == 1e6
    back = config_to_hf(cfg)
    assert back["rope_parameters"]["factor"] == 4.0 and back["num_experts"] == 8
    assert config_to_hf(config_from_hf(back)) == back
    with pytest.raises(ValueError, match="model_type"):
        config_from_hf({**legacy, "model_type": "mistral"})
    with pytest.raises(ValueError, match="num_foo_layers"):
        config_from_hf({**legacy, "num_foo_layers": 3})
    with pytest.raises(ValueError, match="num_key_value_heads"):
        Qwen3Config(num_attention_heads=4, num_key_value_heads=3)
    with pytest.raises(ValueError, match="sliding"):
        Qwen3Config(use_sliding_window=True)


def _autograd_names(t: torch.Tensor) -> set[str]:
    names, todo = set(), [t.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is not None and fn.name() not in names:
            names.add(fn.name())
            todo += [nxt for nxt, _ in fn.next_functions]
    return names


@pytest.mark.parametrize("grad_in_forward", [None, False])
def test_loss_gradients_equal_materialised_cross_entropy(grad_in_forward):
    """The head's loss (one-pass by default, two-pass with ``grad_in_forward=False``) gives the model the
    gradients of plain ``F.cross_entropy`` over materialised logits."""
    cfg = Qwen3Config(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4
    )
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg)
    model.reset_parameters()
    model.lm_head.grad_in_forward = grad_in_forward
    ids = torch.randint(0, 96, (2, 6))
    labels = torch.randint(0, 96, (2, 6))
    labels[1, 2] = -100
    out = model(input_ids=ids, labels=labels)
    one_pass = ("linear_cross_entropy_fused", "OnePassEager")  # the custom op's node, the eager Function's
    assert any(k in n for n in _autograd_names(out["loss"]) for k in one_pass) == (grad_in_forward is None)
    (out["loss"] * 2.5).backward()
    got = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    logits = model(input_ids=ids, labels=labels, return_logits=True)["logits"]
    (F.cross_entropy(logits.flatten(0, 1), labels.flatten()) * 2.5).backward()
    for k, p in model.named_parameters():
        torch.testing.assert_close(got[k], p.grad, atol=1e-6, rtol=1e-4, msg=k)


class _HostReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the ops that read a tensor's value on the host (a device sync on a GPU)."""

    READS = ("aten.is_nonzero.default", "aten._local_scalar_dense.default", "aten.item.default")

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func) in self.READS:
            self.reads.append(str(func))
        return func(*args, **(kwargs or {}))


def test_forward_without_positions_reads_nothing_on_the_host():
    """Default positions cannot mark packed documents: the forward must not look for restarts in them
    (``bool(...any())`` is a host read, a device sync per forward on a GPU that stalls FSDP's overlap)."""
    cfg = Qwen3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8,
    )  # fmt: skip
    model = Qwen3ForCausalLM(cfg)
    ids = torch.randint(0, 64, (2, 16))
    with _HostReads() as mode:
        out = model(input_ids=ids, labels=ids)
    assert mode.reads == [], mode.reads
    # positions that restart still mark documents (that read is the price of deriving them)
    with _HostReads() as mode:
        model(input_ids=ids, labels=ids, position_ids=torch.arange(16).remainder(8).expand(2, 16))
    assert mode.reads
    assert torch.isfinite(out["loss"])
