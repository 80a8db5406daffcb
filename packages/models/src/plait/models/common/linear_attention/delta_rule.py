"""The gated delta rule (gated DeltaNet's token mixer) in plain PyTorch: a chunked form for training
and a token-by-token recurrence in float64 as the reference.

Per value head, with a state ``S [dk, dv]`` that starts at 0 and restarts at every document start::

    S_t = exp(g_t) * S_{t-1}
    S_t = S_t + k_t (beta_t * (v_t - S_t^T k_t))^T
    o_t = S_t^T (q_t * dk ** -0.5)

``q``/``k`` are L2-normalised first; each query/key head serves ``num_v_heads // num_k_heads``
consecutive value heads. The chunked form (the UT transform of DeltaNet) is exact: within a chunk
the pairwise decays are masked to the causal, same-document pairs, and the state carried into a
chunk reaches only the tokens of the document it belongs to.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["chunk_gated_delta_rule", "l2norm", "recurrent_gated_delta_rule"]


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dimension (the convention of fla and transformers)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _heads_first(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype, qk_l2norm: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q/k repeated to the value heads, all ``[B, H, S, D]`` in ``dtype``, q/k normalised, q scaled."""
    rep = v.shape[2] // q.shape[2]
    if rep > 1:
        q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
    # Contiguous copies: the chunk views below are then plain views (also in compiled backwards).
    q, k, v = (x.transpose(1, 2).to(dtype, memory_format=torch.contiguous_format) for x in (q, k, v))
    if qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    return q * q.shape[-1] ** -0.5, k, v


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> None:
    b, s, hk, _ = q.shape
    hv = v.shape[2]
    if k.shape != q.shape or v.shape[:2] != (b, s) or hv % hk:
        raise ValueError(
            f"gated delta rule: q {tuple(q.shape)} and k {tuple(k.shape)} must match and v {tuple(v.shape)} "
            "must have a multiple of their heads"
        )
    if g.shape != (b, s, hv) or beta.shape != (b, s, hv):
        raise ValueError(
            f"gated delta rule: g {tuple(g.shape)} and beta {tuple(beta.shape)} must be {(b, s, hv)}"
        )


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    document_ids: torch.Tensor | None = None,
    chunk_size: int = 64,
    qk_l2norm: bool = True,
) -> torch.Tensor:
    """The gated delta rule by chunks of ``chunk_size`` tokens, accumulated in float32.

    Args:
        q: ``[B, S, Hk, dk]`` queries.
        k: ``[B, S, Hk, dk]`` keys.
        v: ``[B, S, Hv, dv]`` values (``Hv`` a multiple of ``Hk``).
        g: ``[B, S, Hv]`` log decays (``<= 0``).
        beta: ``[B, S, Hv]`` write strengths.
        document_ids: ``[B, S]`` ids of packed documents (the state restarts where the id changes),
            or None for one document per row.
        chunk_size: Tokens per chunk (any length is padded to a multiple).
        qk_l2norm: L2-normalise q and k first.

    Returns:
        ``[B, S, Hv, dv]`` in ``q``'s dtype.
    """
    _check(q, k, v, g, beta)
    out_dtype = q.dtype
    bsz, seq = q.shape[:2]
    q, k, v = _heads_first(q, k, v, torch.float32, qk_l2norm)
    g, beta = (x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format) for x in (g, beta))
    pad = -seq % chunk_size
    if pad:  # padded tokens write nothing (k = v = beta = 0) and do not decay (g = 0)
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    n = (seq + pad) // chunk_size
    heads = q.shape[1]

    def chunks(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(bsz, heads, n, chunk_size, *x.shape[3:])

    q, k, v, g, beta = (chunks(x) for x in (q, k, v, g, beta))
    cum = g.cumsum(-1)  # [B, H, n, C]: log decay from the chunk start to each token
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    if document_ids is None:
        keep = causal
        carried = last_carried = None  # the carried state reaches every token
    else:
        docs = document_ids.to(q.device)
        if pad:
            docs = torch.cat([docs, docs[:, -1:].expand(bsz, pad)], dim=1)  # padding joins the last one
        docs = docs.reshape(bsz, 1, n, chunk_size)
        keep = causal & (docs.unsqueeze(-1) == docs.unsqueeze(-2))  # [B, 1, n, C, C]
        # The state entering chunk c belongs to the document of the token before it.
        before = torch.cat([docs[:, :, :1, :1], docs[:, :, :-1, -1:]], dim=2)  # [B, 1, n, 1]
        carried = (docs == before).float()  # [B, 1, n, C]
        last_carried = carried[..., -1]
    # exp(cum_i - cum_j) for the causal pairs of one document; 0 elsewhere.
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(~keep, float("-inf")).exp()
    k_beta, v_beta = k * beta.unsqueeze(-1), v * beta.unsqueeze(-1)
    from_start = cum.exp() if carried is None else cum.exp() * carried
    # UT transform: (I + tril(A, -1)) u = v_beta - diag(beta exp(cum)) K S_0, solved for both terms.
    system = (k_beta @ k.transpose(-1, -2)) * decay
    u = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(
        system, k_beta * from_start.unsqueeze(-1), upper=False, unitriangular=True
    )
    attn = (q @ k.transpose(-1, -2)) * decay
    q_start = q * from_start.unsqueeze(-1)
    to_end = (cum[..., -1:] - cum).exp()
    if document_ids is not None:
        to_end = to_end * keep[..., -1, :].float()  # only the last token's document reaches the next chunk
    k_end = k * to_end.unsqueeze(-1)
    chunk_decay = cum[..., -1].exp() if last_carried is None else cum[..., -1].exp() * last_carried
    state = q.new_zeros(bsz, heads, q.shape[-1], v.shape[-1])
    outs = []
    for c in range(n):
        v_new = u[:, :, c] - w[:, :, c] @ state
        outs.append(q_start[:, :, c] @ state + attn[:, :, c] @ v_new)
        state = state * chunk_decay[:, :, c, None, None] + k_end[:, :, c].transpose(-1, -2) @ v_new
    o = torch.stack(outs, dim=2).reshape(bsz, heads, n * chunk_size, -1)[:, :, :seq]
    return o.transpose(1, 2).contiguous().to(out_dtype)


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    document_ids: torch.Tensor | None = None,
    qk_l2norm: bool = True,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """The gated delta rule token by token in ``dtype`` (float64: the reference of the chunked form
    and of the fused kernels). Same arguments and result as :func:`chunk_gated_delta_rule`."""
    _check(q, k, v, g, beta)
    out_dtype = q.dtype
    q, k, v = _heads_first(q, k, v, dtype, qk_l2norm)
    g, beta = g.transpose(1, 2).to(dtype), beta.transpose(1, 2).to(dtype)
    bsz, heads, seq, dk = q.shape
    state = q.new_zeros(bsz, heads, dk, v.shape[-1])
    outs = []
    for t in range(seq):
        if document_ids is not None and t > 0:
            same = (document_ids[:, t] == document_ids[:, t - 1]).to(q.device, dtype)
            state = state * same[:, None, None, None]
        state = state * g[:, :, t].exp()[..., None, None]
        k_t = k[:, :, t]
        delta = (v[:, :, t] - (state * k_t.unsqueeze(-1)).sum(-2)) * beta[:, :, t].unsqueeze(-1)
        state = state + k_t.unsqueeze(-1) * delta.unsqueeze(-2)
        outs.append((state * q[:, :, t].unsqueeze(-1)).sum(-2))
    return torch.stack(outs, dim=2).transpose(1, 2).contiguous().to(out_dtype)
