"""The one place plait.models calls private aten attention ops (SDPA kernels that return their
log-sum-exp, and their backwards, called positionally).

``tests/models/test_context_parallel.py`` checks their schemas against what this module passes, so a
torch upgrade that changes them fails there, loudly, instead of here, silently.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["FORWARD_OPS", "SdpaLseKernel", "chunk_kernels_available"]

# The ops (and the argument names, in order) this module passes positionally.
FORWARD_OPS = {
    "_scaled_dot_product_cudnn_attention": (
        "query",
        "key",
        "value",
        "attn_bias",
        "compute_log_sumexp",
        "dropout_p",
        "is_causal",
        "return_debug_mask",
    ),
    "_scaled_dot_product_cudnn_attention_backward": (
        "grad_out",
        "query",
        "key",
        "value",
        "out",
        "logsumexp",
        "philox_seed",
        "philox_offset",
        "attn_bias",
        "cum_seq_q",
        "cum_seq_k",
        "max_q",
        "max_k",
        "dropout_p",
        "is_causal",
    ),
    "_scaled_dot_product_flash_attention_for_cpu": ("query", "key", "value", "dropout_p", "is_causal"),
    "_scaled_dot_product_flash_attention_for_cpu_backward": (
        "grad_out",
        "query",
        "key",
        "value",
        "out",
        "logsumexp",
        "dropout_p",
        "is_causal",
    ),
}


def chunk_kernels_available(device: torch.device, dtype: torch.dtype | None) -> bool:
    """Whether :class:`SdpaLseKernel` serves ``device`` and ``dtype`` (CPU; CUDA cuDNN fp16/bf16, Hopper+)."""
    if device.type == "cpu":
        return True
    return (
        device.type == "cuda"
        and dtype in (torch.float16, torch.bfloat16)
        and torch.backends.cudnn.is_available()
        and torch.backends.cuda.cudnn_sdp_enabled()
        and torch.cuda.get_device_capability(device) >= (9, 0)
    )


class SdpaLseKernel:
    """An SDPA kernel that returns its log-sum-exp, and its backward given any output and log-sum-exp.

    cuDNN on CUDA, FlashAttention-for-CPU on CPU (both take fewer K/V heads than query heads).
    Tensors are ``[B, H, L, D]``; the log-sum-exp is ``[B, Hq, L]``.
    """

    def __init__(self, device: torch.device, scale: float) -> None:
        self.cuda, self.scale = device.type == "cuda", scale

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[Any, ...]]:
        """(out, log-sum-exp, what the backward needs of this call)."""
        aten = torch.ops.aten
        if self.cuda:
            r = aten._scaled_dot_product_cudnn_attention(
                q, k, v, None, True, 0.0, causal, False, scale=self.scale
            )
            return r[0], r[1].squeeze(-1), tuple(r[2:8])
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=self.scale)
        return out, lse, ()

    def backward(
        self,
        grad: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        state: tuple[Any, ...],
        causal: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(dq, dk, dv) of one call, with the softmax of ``out`` / ``lse`` (those of the whole row)."""
        aten = torch.ops.aten
        if self.cuda:
            cum_q, cum_k, max_q, max_k, seed, offset = state
            return aten._scaled_dot_product_cudnn_attention_backward(  # type: ignore[no-any-return]
                grad,
                q,
                k,
                v,
                out,
                lse.unsqueeze(-1),
                seed,
                offset,
                None,
                cum_q,
                cum_k,
                max_q,
                max_k,
                0.0,
                causal,
                scale=self.scale,
            )
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(  # type: ignore[no-any-return]
            grad, q, k, v, out, lse, 0.0, causal, scale=self.scale
        )
