"""Blockwise linear + cross-entropy vs a float64 materialised reference (incl. vocab-parallel on gloo)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from plait.kernels import linear_cross_entropy
from plait.kernels._dispatch import use_triton

from tests.kernels.conftest import to64


def _ref(x, w, t, ignore_index=-100, reduction="mean", z_loss=0.0, softcap=None):
    logits = x @ w.T
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    lse = torch.logsumexp(logits, -1)
    ce = F.cross_entropy(logits, t, ignore_index=ignore_index, reduction="none")
    loss = torch.where(t != ignore_index, ce + z_loss * lse**2, 0.0)
    n = (t != ignore_index).sum()
    red = {"none": loss, "sum": loss.sum(), "mean": loss.sum() / n}[reduction]
    return red, lse


CASES = [
    {},
    {"reduction": "sum", "z_loss": 1e-3},
    {"reduction": "none", "softcap": 4.0},
    {"reduction": "mean", "softcap": 3.0, "z_loss": 1e-2, "return_lse": True},
]


def check_lce(dtype, n, h, v, kw, chunks=(5, 16), device="cpu"):
    torch.manual_seed(0)
    x = (torch.randn(n, h, device=device) * 0.5).to(dtype).requires_grad_()
    w = (torch.randn(v, h, device=device) * 0.5).to(dtype).requires_grad_()
    t = torch.randint(0, v, (n,), device=device)
    t[1::4] = -100
    kw = dict(kw)
    ret_lse = kw.pop("return_lse", False)
    out = linear_cross_entropy(
        x, w, t, return_lse=ret_lse, chunk_tokens=chunks[0], chunk_vocab=chunks[1], **kw
    )
    loss, lse = out if ret_lse else (out, None)
    assert loss.dtype == torch.float32
    torch.manual_seed(1)
    g = torch.randn_like(loss)
    total = (loss * g).sum() + (lse.sum() * 0.3 if ret_lse else 0)
    total.backward()
    x64, w64 = to64(x, w)
    loss64, lse64 = _ref(x64, w64, t, **kw)
    total64 = (loss64 * g.double()).sum() + (lse64.sum() * 0.3 if ret_lse else 0)
    total64.backward()
    # bf16: logits tiles are bf16 like eager PyTorch; errors scale with |logits| ~ sqrt(H)/4.
    tol = {"atol": 2e-5, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 6e-2, "rtol": 3e-2}
    torch.testing.assert_close(loss.double(), loss64, **tol)
    if ret_lse:
        torch.testing.assert_close(lse.double(), lse64.detach(), **tol)
    torch.testing.assert_close(x.grad.double(), x64.grad, **tol)
    torch.testing.assert_close(w.grad.double(), w64.grad, **tol)
    return use_triton(x)


# The interpreter is slow: the Triton path runs every option in fp32 and the default in bf16.
MATRIX = [(torch.float32, kw) for kw in CASES] + [(torch.bfloat16, kw) for kw in CASES]
TRITON_MATRIX = [(torch.float32, kw) for kw in CASES] + [(torch.bfloat16, CASES[0])]


@pytest.mark.parametrize("dtype,kw", MATRIX)
def test_linear_ce_matches_float64(dtype, kw):
    assert not check_lce(dtype, 13, 8, 37, kw)


@pytest.mark.parametrize("dtype,kw", TRITON_MATRIX)
def test_linear_ce_triton_interpreted_matches_float64(interpreter_pool, dtype, kw):
    assert interpreter_pool.apply(check_lce, (dtype, 13, 8, 37, kw))


def test_linear_ce_single_chunk_and_one_row():
    check_lce(torch.float32, 1, 8, 5, {"reduction": "sum"}, chunks=(1024, 4096))
    check_lce(torch.float32, 7, 8, 33, {"reduction": "sum"}, chunks=(3, 7))


def test_linear_ce_all_ignored_mean_is_zero():
    x = torch.randn(3, 4, requires_grad=True)
    w = torch.randn(5, 4, requires_grad=True)
    loss = linear_cross_entropy(x, w, torch.full((3,), -100))
    loss.backward()
    assert loss.item() == 0.0 and x.grad.abs().sum() == 0


def test_linear_ce_does_not_materialise_logits(monkeypatch):
    # Every matmul the op runs must be a tile no larger than chunk_tokens x chunk_vocab.
    seen = []
    orig = torch.Tensor.__matmul__

    def spy(a, b):
        out = orig(a, b)
        seen.append(out.numel())
        return out

    monkeypatch.setattr(torch.Tensor, "__matmul__", spy)
    x = torch.randn(64, 8, requires_grad=True)
    w = torch.randn(300, 8, requires_grad=True)
    linear_cross_entropy(x, w, torch.randint(0, 300, (64,)), chunk_tokens=16, chunk_vocab=32).backward()
    assert seen and max(seen) <= 16 * 32


def test_linear_ce_bad_input():
    with pytest.raises(ValueError, match="reduction"):
        linear_cross_entropy(
            torch.randn(2, 4), torch.randn(5, 4), torch.zeros(2, dtype=torch.long), reduction="avg"
        )
    with pytest.raises(ValueError, match="targets"):
        linear_cross_entropy(torch.randn(2, 4), torch.randn(5, 4), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="weight"):
        linear_cross_entropy(torch.randn(2, 4), torch.randn(5, 3), torch.zeros(2, dtype=torch.long))


def test_linear_ce_cce_backend_missing_names_extra():
    pytest.importorskip("torch")
    try:
        import cut_cross_entropy  # noqa: F401

        pytest.skip("cut-cross-entropy is installed")
    except ImportError:
        pass
    with pytest.raises(ImportError, match=r"plait-kernels\[cce\]"):
        linear_cross_entropy(
            torch.randn(2, 4), torch.randn(5, 4), torch.zeros(2, dtype=torch.long), backend="cce"
        )


# --- vocab-parallel -----------------------------------------------------------------------------


def _vocab_parallel_rank(x, w, t, sizes, kw):
    import torch.distributed as dist

    rank = dist.get_rank()
    start = sum(sizes[:rank])
    w_local = w[start : start + sizes[rank]].clone().requires_grad_()
    xl = x.clone().requires_grad_()
    out = linear_cross_entropy(
        xl, w_local, t, process_group=dist.group.WORLD, chunk_tokens=4, chunk_vocab=6, **kw
    )
    loss, lse = out if kw.get("return_lse") else (out, None)
    total = loss.sum() + (lse.sum() * 0.5 if lse is not None else 0)
    total.backward()
    return loss.detach(), xl.grad, w_local.grad


@pytest.mark.parametrize(
    "kw", [{}, {"reduction": "none", "z_loss": 1e-2, "softcap": 5.0, "return_lse": True}]
)
def test_linear_ce_vocab_parallel_gloo(kw):
    testing = pytest.importorskip("plait.dist_core.testing")
    torch.manual_seed(0)
    n, h, sizes = 9, 8, [10, 7]  # uneven shards
    x = torch.randn(n, h)
    w = torch.randn(sum(sizes), h)
    t = torch.randint(0, sum(sizes), (n,))
    t[2] = -100
    results = testing.run_distributed(_vocab_parallel_rank, 2, x, w, t, sizes, kw)
    x64, w64 = to64(x.requires_grad_(), w.requires_grad_())
    rkw = {k: v for k, v in kw.items() if k != "return_lse"}
    loss64, lse64 = _ref(x64, w64, t, **rkw)
    total64 = loss64.sum() + (lse64.sum() * 0.5 if kw.get("return_lse") else 0)
    total64.backward()
    for loss, gx, _ in results:
        torch.testing.assert_close(loss.double(), loss64.detach(), atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(gx.double(), x64.grad, atol=1e-5, rtol=1e-4)
    gw = torch.cat([r[2] for r in results])
    torch.testing.assert_close(gw.double(), w64.grad, atol=1e-5, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_ce_gpu_real_shapes(dtype):
    assert check_lce(dtype, 1000, 512, 5003, CASES[3], chunks=(256, 1024), device="cuda")
    assert check_lce(dtype, 2048, 1024, 32000, {}, chunks=(None, None), device="cuda")
