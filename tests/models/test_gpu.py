"""CUDA-only: attention backends agree in bf16 (FlashAttention when installed, FlexAttention, SDPA),
with and without packed documents and padding."""

from __future__ import annotations

import pytest
import torch
from plait.models import build_attention_mask
from plait.models.common.attention import attention, flash_attn_available


@pytest.mark.gpu
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("packed", [False, True])
def test_backends_agree_on_cuda(packed, padded):
    torch.manual_seed(0)
    b, s, h, kv, d = 2, 256, 8, 2, 64
    dev = torch.device("cuda")
    q = torch.randn(b, s, h, d, device=dev, dtype=torch.bfloat16)
    k = torch.randn(b, s, kv, d, device=dev, dtype=torch.bfloat16)
    v = torch.randn(b, s, kv, d, device=dev, dtype=torch.bfloat16)
    docs = torch.cat([torch.zeros(b, 100), torch.ones(b, 156)], 1).long().to(dev) if packed else None
    pad = None
    if padded:  # row 0 left-padded by 37 tokens, row 1 right-padded by 50
        pad = torch.ones(b, s, dtype=torch.long, device=dev)
        pad[0, :37] = 0
        pad[1, -50:] = 0
    kw = {"document_ids": docs, "attention_mask": pad}
    ref_mask = build_attention_mask(b, s, dev, torch.float32, **kw, implementation="sdpa")
    ref = attention(q.float(), k.float(), v.float(), ref_mask, d**-0.5)
    real = torch.ones(b, s, dtype=torch.bool, device=dev) if pad is None else pad.bool()
    backends = ["sdpa", "flex"] + (["flash"] if flash_attn_available() else [])
    for backend in backends:
        mask = build_attention_mask(b, s, dev, q.dtype, **kw, implementation=backend)
        out = attention(q, k, v, mask, d**-0.5)
        torch.testing.assert_close(out.float()[real], ref[real], atol=2e-2, rtol=2e-2, msg=backend)


@pytest.mark.gpu
def test_block_mask_is_built_without_the_dense_mask():
    """The FlexAttention block mask of a long packed sequence: the same blocks as eager
    ``create_block_mask`` (small shape), and at 64k x 128k (a cp=2 shard's queries against the whole
    sequence) no dense mask: the dense bool mask alone would take 8 GiB."""
    from plait.models.common.attention import AttentionKernels
    from torch.nn.attention.flex_attention import create_block_mask

    dev = torch.device("cuda")
    flex_block_mask = AttentionKernels().block_mask

    def packed_mask(q_len: int, kv_len: int):
        docs = (torch.arange(kv_len, device=dev) // 3000)[None]  # documents cross block boundaries
        q_pos = torch.arange(kv_len - q_len, kv_len, device=dev)  # the last q_len positions

        def mask_mod(b, h, q_idx, kv_idx):
            return (q_pos[q_idx] >= kv_idx) & (docs[b, q_pos[q_idx]] == docs[b, kv_idx])

        return mask_mod

    small = packed_mask(1024, 2048)
    got = flex_block_mask(small, 1, 1024, 2048, dev)
    want = create_block_mask(small, 1, None, 1024, 2048, device=dev)
    assert torch.equal(got.to_dense(), want.to_dense())

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    mask = flex_block_mask(packed_mask(65536, 131072), 1, 65536, 131072, dev)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - before < 2**30, "the dense mask was materialised"
    assert mask.shape[-2:] == (65536, 131072)


@pytest.mark.gpu
def test_materialize_leaves_the_cuda_generator_as_it_was():
    from plait.models import CausalLMProvider
    from plait.models.qwen3 import Qwen3MoeConfig

    cfg = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, moe_intermediate_size=16,
                         num_experts=4, num_experts_per_tok=2)  # fmt: skip
    provider = CausalLMProvider(cfg, seed=3)
    torch.cuda.manual_seed(11)
    before = torch.cuda.get_rng_state()
    provider.materialize(provider.build_stage(0, 1), "cuda")
    assert torch.equal(torch.cuda.get_rng_state(), before)
