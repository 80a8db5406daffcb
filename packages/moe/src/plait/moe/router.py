"""Top-k router: scores, group-limited selection, selection-only expert bias, balancing losses."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from plait.moe.config import RouterConfig
from plait.moe.losses import (
    balancing_probs,
    count_tokens_per_expert,
    router_z_loss,
    seq_aux_loss,
    switch_aux_loss_from_stats,
    switch_loss_stats,
)
from torch import Tensor, nn


@dataclass(frozen=True)
class RouterOutput:
    """What a router decided for ``T`` tokens.

    Attributes:
        logits: ``[T, E]`` router logits (with the router's ``bias``, if any) in the input dtype,
            fp32 with ``fp32_logits``.
        topk_idx: ``[T, k]`` int64 chosen experts.
        topk_weights: ``[T, k]`` combine weights in the input dtype.
        aux_loss: fp32 scalar, the coefficient-weighted sum of the enabled balancing losses (without
            the Switch loss when ``aux_loss_pooling="all_layers"``).
        tokens_per_expert: ``[E]`` int64 assignments of real tokens in this call (detached).
        losses: unweighted, detached components (``"switch"``, ``"seq"``, ``"z"``) for logging.
        switch_stats: fp32 ``[2E + 1]`` Switch-loss statistics (:func:`plait.moe.switch_loss_stats`)
            when ``aux_loss_coef > 0``, else None; summed over the router's ``context_group`` (if set).
    """

    logits: Tensor
    topk_idx: Tensor
    topk_weights: Tensor
    aux_loss: Tensor
    tokens_per_expert: Tensor
    losses: dict[str, Tensor] = field(default_factory=dict)
    switch_stats: Tensor | None = None


def in_recomputation() -> bool:
    """True while autograd's engine runs a backward pass on this thread.

    ``torch.utils.checkpoint`` (reentrant and not) re-runs the forward inside backward; a forward
    seen there is a recomputation, so statistics must not be counted again. Outside backward the
    current graph task id is -1.
    """
    return torch._C._current_graph_task_id() != -1  # noqa: SLF001  no public "inside backward" query


@torch.library.custom_op(
    "plait::moe_count_assignments",
    mutates_args=("bias_counts", "stat_counts"),
    schema="(Tensor(a!) bias_counts, Tensor(b!) stat_counts, Tensor counts) -> ()",
)
def _count_assignments(bias_counts: Tensor, stat_counts: Tensor, counts: Tensor) -> None:
    """Add ``counts`` to both accumulators unless this forward is a recomputation.

    A custom op so that the recomputation check runs when the op runs: a compiled forward replays
    its graph in a recomputation, and a check made while tracing would be frozen into it.
    """
    if not in_recomputation():
        bias_counts.add_(counts)
        stat_counts.add_(counts)


@_count_assignments.register_fake
def _(bias_counts: Tensor, stat_counts: Tensor, counts: Tensor) -> None:
    return None


class TopKRouter(nn.Module):
    """Linear router ``[E, H]`` with top-k selection and load-balancing machinery.

    Numerics follow Hugging Face Qwen3-MoE by default: logits in the input dtype, softmax/sigmoid in
    fp32, top-k, optional renormalisation, weights cast back to the input dtype. ``score_func=
    "softmax_over_topk"`` is gpt-oss's router (top-k of the logits, softmax over the k picked ones),
    ``"sigmoid"`` with ``fp32_logits``, a selection bias and groups DeepSeek-V3's.

    Parameters: ``weight`` ``[E, H]``; ``bias`` ``[E]`` with ``logit_bias`` (else None).

    Buffers: ``expert_bias`` (fp32 ``[E]``, persistent, when ``config.has_selection_bias``) is
    added to the scores for *selection only*; two non-persistent int64 accumulators count the
    assignments of training forwards (not recomputations) since the last bias update and since the
    last :meth:`tokens_per_expert_stats` read. They stay on device: reading them is the only sync.

    ``context_group`` (set by a context-parallel plan; default None): the ranks that hold the other
    tokens of the same sequences; the balancing losses are then those of the whole sequences (see
    :mod:`plait.moe.losses`), and ``switch_stats`` are summed over the group, so statistics pooled
    over layers are those of the whole sequences too. Routing and the load counters stay per rank.
    """

    expert_bias: Tensor | None
    bias: nn.Parameter | None
    _bias_counts: Tensor
    _stat_counts: Tensor

    def __init__(self, hidden_size: int, num_experts: int, config: RouterConfig) -> None:
        super().__init__()
        config.validate_for(num_experts)
        self.config = config
        self.hidden_size = hidden_size
        self.num_experts = num_experts
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.bias = nn.Parameter(torch.empty(num_experts)) if config.logit_bias else None
        if config.has_selection_bias:
            self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32))
        else:
            self.expert_bias = None
        self.register_buffer("_bias_counts", torch.zeros(num_experts, dtype=torch.int64), persistent=False)
        self.register_buffer("_stat_counts", torch.zeros(num_experts, dtype=torch.int64), persistent=False)
        self.context_group: dist.ProcessGroup | None = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """nn.Linear's default init for the router weight (and logit bias); zero expert bias and load counters."""
        bound = 1.0 / math.sqrt(self.hidden_size)
        with torch.no_grad():
            self.weight.uniform_(-bound, bound)
            if self.bias is not None:
                self.bias.uniform_(-bound, bound)
            if self.expert_bias is not None:
                self.expert_bias.zero_()
        self.reset_counters()

    @torch.no_grad()
    def reset_counters(self) -> None:
        """Zero the load counters (non-persistent buffers: no checkpoint restores them, so a module
        materialised from the meta device and then loaded needs this)."""
        self._bias_counts.zero_()
        self._stat_counts.zero_()

    def _select(self, scores: Tensor) -> Tensor:
        """Top-k expert indices from the (biased, group-limited) selection scores."""
        cfg = self.config
        sel = scores if self.expert_bias is None else scores + self.expert_bias.detach()
        if cfg.n_groups is not None and cfg.topk_groups is not None:
            t = sel.shape[0]
            grouped = sel.view(t, cfg.n_groups, -1)
            if cfg.group_score == "max":
                group_scores = grouped.amax(dim=-1)
            else:
                group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
            keep = group_scores.topk(cfg.topk_groups, dim=-1).indices
            group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
            sel = grouped.masked_fill(~group_mask[..., None], float("-inf")).view(t, -1)
        return torch.topk(sel, cfg.top_k, dim=-1).indices

    def forward(self, x: Tensor, num_sequences: int = 1, token_mask: Tensor | None = None) -> RouterOutput:
        """Route ``x`` ``[T, H]``.

        Args:
            x: Tokens, sequence-major when ``num_sequences > 1``.
            num_sequences: Sequences in ``x`` (for the sequence-level loss).
            token_mask: ``[T]`` bool, False = padding: routed like any token, but left out of the
                balancing losses and the load statistics.
        """
        cfg = self.config
        if cfg.fp32_logits:
            bias = None if self.bias is None else self.bias.float()
            logits = F.linear(x.float(), self.weight.float(), bias)
        else:
            logits = F.linear(x, self.weight, self.bias)
        logits32 = logits.float()
        if cfg.score_func == "softmax":
            scores = torch.softmax(logits32, dim=-1)
        elif cfg.score_func == "sigmoid":
            scores = torch.sigmoid(logits32)
        else:  # "softmax_over_topk": the experts are picked by their raw logits
            scores = logits32
        if self.expert_bias is None and cfg.n_groups is None:
            # Exactly Hugging Face's path (same topk call on the same tensor -> same tie-breaking).
            topk_w, topk_idx = torch.topk(scores, cfg.top_k, dim=-1)
        else:
            topk_idx = self._select(scores)
            topk_w = scores.gather(1, topk_idx)
        if cfg.score_func == "softmax_over_topk":
            topk_w = torch.softmax(topk_w, dim=-1)
        if cfg.norm_topk_prob:
            denom = topk_w.sum(dim=-1, keepdim=True)
            topk_w = topk_w / (denom + 1e-20 if cfg.score_func == "sigmoid" else denom)
        if cfg.scaling_factor != 1.0:
            topk_w = topk_w * cfg.scaling_factor
        topk_w = topk_w.to(x.dtype)

        counts = count_tokens_per_expert(topk_idx.detach(), self.num_experts, token_mask)
        if self.training:
            _count_assignments(self._bias_counts, self._stat_counts, counts)

        aux = logits32.new_zeros(())
        losses: dict[str, Tensor] = {}
        stats: Tensor | None = None
        if cfg.aux_loss_coef > 0 or cfg.seq_aux_loss_coef > 0:
            probs = balancing_probs(scores, cfg.score_func)
            if cfg.aux_loss_coef > 0:
                stats = switch_loss_stats(probs, topk_idx, self.num_experts, token_mask, self.context_group)
                sw = switch_aux_loss_from_stats(stats)
                if cfg.aux_loss_pooling == "per_layer":
                    aux = aux + cfg.aux_loss_coef * sw
                losses["switch"] = sw.detach()
            if cfg.seq_aux_loss_coef > 0:
                sq = seq_aux_loss(
                    probs, topk_idx, self.num_experts, num_sequences, token_mask, self.context_group
                )
                aux = aux + cfg.seq_aux_loss_coef * sq
                losses["seq"] = sq.detach()
        if cfg.z_loss_coef > 0:
            z = router_z_loss(logits32, token_mask, self.context_group)
            aux = aux + cfg.z_loss_coef * z
            losses["z"] = z.detach()
        return RouterOutput(logits, topk_idx, topk_w, aux, counts, losses, stats)

    def tokens_per_expert_stats(self, reset: bool = True) -> Tensor:
        """Assignments per expert summed over training forwards since the last read.

        Returns a device tensor (no sync here; call ``.tolist()`` when you log).
        """
        out = self._stat_counts.clone()
        if reset:
            self._stat_counts.zero_()
        return out

    @torch.no_grad()
    def update_expert_bias(self, group: object = None) -> Tensor:
        """Auxiliary-loss-free balancing step: ``bias += rate * sign(mean_count - count)``.

        Call once after each optimizer step. Counts are those accumulated since the previous call
        (training forwards only, each microbatch once even under activation recomputation), summed
        over ``group`` so every replica applies the same update.

        Args:
            group: The data-parallel ranks that hold replicas of this router: a ``ProcessGroup``, a
                ``DeviceMesh`` (all its dimensions are reduced), or ``None`` for no reduction.

        Returns:
            The (reduced) counts the update used.
        """
        if self.expert_bias is None or self.config.bias_update_rate is None:
            raise RuntimeError(
                "update_expert_bias: RouterConfig.bias_update_rate is not set for this router (its selection "
                "bias, if any, is fixed)"
            )
        counts = self._bias_counts.clone()
        all_reduce_sum(counts, group)
        counts_f = counts.to(torch.float32)
        self.expert_bias.add_(self.config.bias_update_rate * torch.sign(counts_f.mean() - counts_f))
        self._bias_counts.zero_()
        return counts


def all_reduce_sum(t: Tensor, group: object) -> None:
    """In-place SUM all-reduce over a process group or every dimension of a device mesh."""
    if group is None:
        return
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(group, DeviceMesh):
        for dim in range(group.ndim):
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group.get_group(dim))
    elif isinstance(group, dist.ProcessGroup):
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    else:
        raise TypeError(f"group must be a ProcessGroup, a DeviceMesh or None, got {type(group).__name__}")
