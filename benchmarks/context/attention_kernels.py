"""The attention kernels behind context parallelism's all-gather mode, on one GPU.

    python3 -m benchmarks.context.attention_kernels

Checks, against an fp32 reference: the cuDNN and FlashAttention SDPA ops with fewer K/V heads than
query heads, which causal alignment each uses when queries and keys differ in length, their
log-sum-exp, and the cuDNN backward given a separately stored output (what the per-chunk path of
``plait.models.common.attention.context`` relies on). Then times forward + backward of the cp=2
rank-0 attention at 32k tokens (16 query heads, 4 K/V heads, head dim 64, bf16): cuDNN per chunk
block, FlexAttention with the block mask, and ``causal_lower_right`` SDPA, against cp=1's full causal
SDPA over 32k.
"""

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from benchmarks.moe._common import cuda_time_ms

aten = torch.ops.aten
dev, dt = "cuda", torch.bfloat16
B, HQ, HK, D, T, n = 1, 16, 4, 64, 32768, 2
c = T // (2 * n)
sc = D**-0.5
torch.manual_seed(0)


def ref(q, k, v, mask):
    kr, vr = k.repeat_interleave(HQ // HK, 1).float(), v.repeat_interleave(HQ // HK, 1).float()
    s = (q.float() @ kr.transpose(-1, -2)) * sc
    s = s.masked_fill(~mask, float("-inf"))
    return torch.softmax(s, -1) @ vr


q = torch.randn(B, HQ, 2048, D, device=dev, dtype=dt)
k = torch.randn(B, HK, 4096, D, device=dev, dtype=dt)
v = torch.randn(B, HK, 4096, D, device=dev, dtype=dt)
i, j = torch.arange(2048, device=dev)[:, None], torch.arange(4096, device=dev)[None]
for name, fn in [
    (
        "cudnn",
        lambda c_: aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, c_, False, scale=sc),
    ),
    ("flash", lambda c_: aten._scaled_dot_product_flash_attention(q, k, v, 0.0, c_, False, scale=sc)),
]:
    for causal in (False, True):
        try:
            r = fn(causal)
            o, lse = r[0], r[1]
            errs = {
                m: (o.float() - ref(q, k, v, mk)).abs().max().item()
                for m, mk in [
                    ("full", torch.ones_like(i >= j)),
                    ("topleft", i >= j),
                    ("lowerright", i + 2048 >= j),
                ]
            }
            print(
                f"{name} causal={causal}: out {tuple(o.shape)} {o.stride()} lse {tuple(lse.shape)} {lse.dtype} err {errs}"
            )
        except Exception as e:
            print(f"{name} causal={causal}: FAILED {type(e).__name__}: {str(e)[:300]}")
# backward with a separate out tensor / grad in the same layout
try:
    o, lse, cq, ck, mq, mk, ps, po, _ = aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, False, False, scale=sc
    )
    out2 = torch.empty_like(o).copy_(o)
    g = torch.randn_like(o)
    g2 = torch.empty_like(o).copy_(g)
    dq, dk, dv = aten._scaled_dot_product_cudnn_attention_backward(
        g2, q, k, v, out2, lse, ps, po, None, cq, ck, mq, mk, 0.0, False, scale=sc
    )
    qq, kk, vv = (x.detach().float().requires_grad_() for x in (q, k, v))
    ref(qq, kk, vv, torch.ones_like(i >= j)).backward(g.float())
    print(
        "cudnn bwd err",
        [(a.float() - b.grad).abs().max().item() for a, b in [(dq, qq), (dk, kk), (dv, vv)]],
        dk.shape,
    )
except Exception as e:
    print("cudnn bwd FAILED", type(e).__name__, str(e)[:300])


# cp=1 full 32k causal (public SDPA)
qf = torch.randn(B, HQ, T, D, device=dev, dtype=dt, requires_grad=True)
kf = torch.randn(B, HK, T, D, device=dev, dtype=dt, requires_grad=True)
vf = torch.randn(B, HK, T, D, device=dev, dtype=dt, requires_grad=True)


def full():
    F.scaled_dot_product_attention(qf, kf, vf, is_causal=True, scale=sc, enable_gqa=True).sum().backward()


print(f"cp=1 sdpa causal 32k fwd+bwd: {cuda_time_ms(full, 3, 10):.2f} ms")
# cp=2 rank 0: query chunks 0 and 3 (of 4)
ql = torch.randn(B, HQ, 2 * c, D, device=dev, dtype=dt, requires_grad=True)
qpos = torch.cat([torch.arange(0, c), torch.arange(3 * c, 4 * c)]).to(dev)
bm = torch.compile(create_block_mask)(lambda b, h, qi, ki: qpos[qi] >= ki, B, None, 2 * c, T, device=dev)
fx = torch.compile(flex_attention, dynamic=False)


def flex():
    fx(ql, kf, vf, block_mask=bm, scale=sc, enable_gqa=True).sum().backward()


print(f"cp=2 flex fwd+bwd: {cuda_time_ms(flex, 3, 10):.2f} ms")


def blocks(bwd=True):
    for s, g in enumerate((0, 3)):
        qc = ql[:, :, s * c : (s + 1) * c].detach()
        parts = [(kf[:, :, g * c : (g + 1) * c].detach(), vf[:, :, g * c : (g + 1) * c].detach(), True)]
        if g:
            parts.append((kf[:, :, : g * c].detach(), vf[:, :, : g * c].detach(), False))
        for kk_, vv_, cz in parts:
            r = aten._scaled_dot_product_cudnn_attention(qc, kk_, vv_, None, True, 0.0, cz, False, scale=sc)
            if bwd:
                aten._scaled_dot_product_cudnn_attention_backward(
                    r[0],
                    qc,
                    kk_,
                    vv_,
                    r[0],
                    r[1],
                    r[6],
                    r[7],
                    None,
                    r[2],
                    r[3],
                    r[4],
                    r[5],
                    0.0,
                    cz,
                    scale=sc,
                )


try:
    print(
        f"cp=2 cudnn blocks fwd+bwd: {cuda_time_ms(blocks, 3, 10):.2f} ms; fwd only {cuda_time_ms(lambda: blocks(False), 3, 10):.2f} ms"
    )
except Exception as e:
    print("cudnn blocks FAILED", type(e).__name__, str(e)[:300])


def lr():
    for s, g in enumerate((0, 3)):
        qc = ql[:, :, s * c : (s + 1) * c]
        e = (g + 1) * c
        F.scaled_dot_product_attention(
            qc, kf[:, :, :e], vf[:, :, :e], attn_mask=causal_lower_right(c, e), scale=sc, enable_gqa=True
        ).sum().backward()


try:
    print(f"cp=2 causal_lower_right fwd+bwd: {cuda_time_ms(lr, 3, 10):.2f} ms")
except Exception as e:
    print("lower_right FAILED", type(e).__name__, str(e)[:300])
