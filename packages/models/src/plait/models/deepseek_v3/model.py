"""DeepSeek-V3: multi-head latent attention; dense SwiGLU layers, then MoE layers with sigmoid,
group-limited routing, a selection-only correction bias and shared experts."""

from __future__ import annotations

from typing import Any

import torch
from plait.models.common import AttentionMask, CausalLMStage, DecoderConfig, DecoderLayer, RMSNorm, SwiGLUMLP
from plait.models.common.attention import document_ids_from_position_ids
from plait.models.deepseek_v3.attention import MultiHeadLatentAttention
from plait.models.deepseek_v3.config import DeepseekV3Config
from plait.moe import MoELayer, RouterConfig
from torch import nn

__all__ = ["DeepseekV3ForCausalLM", "MultiTokenPrediction", "deepseek_v3_layer", "deepseek_v3_router"]


def deepseek_v3_router(config: DeepseekV3Config) -> RouterConfig:
    """DeepSeek-V3's routing as a :class:`plait.moe.RouterConfig`: sigmoid scores (fp32 logits),
    groups scored by their two best biased scores, the correction bias (``router.expert_bias``) for
    selection only, ``norm_topk_prob``, ``routed_scaling_factor``; the bias trained the
    auxiliary-loss-free way when ``bias_update_rate`` is set."""
    return RouterConfig(
        score_func="sigmoid",
        fp32_logits=True,
        top_k=config.num_experts_per_tok,
        norm_topk_prob=config.norm_topk_prob,
        scaling_factor=config.routed_scaling_factor,
        n_groups=config.n_group,
        topk_groups=config.topk_group,
        group_score="top2_sum",
        selection_bias=True,
        bias_update_rate=config.bias_update_rate,
        seq_aux_loss_coef=config.seq_aux_loss_coef,
    )


def deepseek_v3_layer(config: DecoderConfig, layer_idx: int) -> DecoderLayer:
    """Decoder layer ``layer_idx`` of a DeepSeek-V3 model."""
    assert isinstance(config, DeepseekV3Config)
    mlp: nn.Module
    if config.is_moe_layer(layer_idx):
        shared = config.n_shared_experts * config.moe_intermediate_size
        mlp = MoELayer(
            config.hidden_size,
            config.moe_intermediate_size,
            config.n_routed_experts,
            deepseek_v3_router(config),
            shared_expert_intermediate_size=shared or None,
        )
    else:
        mlp = SwiGLUMLP(config.hidden_size, config.intermediate_size)
    attn = MultiHeadLatentAttention(config)
    return DecoderLayer(layer_idx, attn, mlp, config.hidden_size, config.rms_norm_eps)


class _SharedHead(nn.Module):
    """The MTP module's output norm (``shared_head.norm``; the head itself is the model's)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.norm = RMSNorm(hidden_size, eps)


class MultiTokenPrediction(nn.Module):
    """One DeepSeek-V3 multi-token-prediction module (depth ``k``): for position ``i``,
    ``h = eh_proj([enorm(embed(t[i + k])); hnorm(h_prev[i])])``, then a decoder layer, then
    ``shared_head.norm``; the model's LM head scores ``t[i + k + 1]``.

    Args:
        config: The DeepSeek-V3 config.
        layer_idx: Global index (``num_hidden_layers + k - 1``, its checkpoint keys' index).
    """

    def __init__(self, config: DeepseekV3Config, layer_idx: int) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.enorm = RMSNorm(h, eps)
        self.hnorm = RMSNorm(h, eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.block = deepseek_v3_layer(config, layer_idx)
        self.shared_head = _SharedHead(h, eps)

    def forward(
        self,
        embeds: torch.Tensor,
        previous: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        mask: AttentionMask,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(embeddings of the tokens k ahead, previous depth's hidden states)`` -> ``(normed
        hidden states, the block's aux loss)``."""
        x = self.eh_proj(torch.cat((self.enorm(embeds), self.hnorm(previous)), dim=-1))
        x, aux, _ = self.block(x, rope, mask)
        return self.shared_head.norm(x), aux

    def reset_parameters(self, std: float) -> None:
        """Unit norms, normal(0, std) projections, the block's init."""
        for norm in (self.enorm, self.hnorm, self.shared_head.norm):
            norm.reset_parameters()
        nn.init.normal_(self.eh_proj.weight, 0.0, std)
        self.block.reset_parameters(std)


def _shift(t: torch.Tensor, k: int, fill: int) -> torch.Tensor:
    """``t[:, i + k]`` at position ``i`` (``fill`` past the end)."""
    return torch.cat((t[:, k:], t.new_full((t.shape[0], k), fill)), dim=1)


class DeepseekV3ForCausalLM(CausalLMStage):
    """DeepSeek-V3 causal LM, or one pipeline stage of it (see :class:`plait.models.CausalLMStage`).

    Args:
        config: :class:`DeepseekV3Config`.
        stage_index: This stage (0-based).
        num_stages: Number of pipeline stages (1 = the whole model).
        ignore_index: Label value that is not scored.
    """

    def __init__(
        self,
        config: DeepseekV3Config,
        *,
        stage_index: int = 0,
        num_stages: int = 1,
        ignore_index: int = -100,
    ) -> None:
        super().__init__(
            config,
            deepseek_v3_layer,
            stage_index=stage_index,
            num_stages=num_stages,
            ignore_index=ignore_index,
        )
        self.mtp: nn.ModuleDict | None = None
        if config.mtp_layer_ids:
            if num_stages != 1:
                raise ValueError(
                    f"mtp_loss_weight={config.mtp_loss_weight} needs the embedding and the head on one stage "
                    f"(num_stages=1, got {num_stages})"
                )
            self.mtp = nn.ModuleDict({str(i): MultiTokenPrediction(config, i) for i in config.mtp_layer_ids})

    def forward(  # type: ignore[override]
        self,
        input_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> dict[str, torch.Tensor]:
        """The causal-LM stage forward (:meth:`CausalLMStage.forward`); with MTP modules and labels,
        ``aux_loss`` also holds ``mtp_loss_weight / D * sum_k`` of their mean cross-entropies (each
        module's MoE aux loss too), and ``mtp_loss`` that weighted term (detached)."""
        kw: dict[str, Any] = dict(
            position_ids=position_ids, document_ids=document_ids, attention_mask=attention_mask, **kwargs
        )
        if self.mtp is None or labels is None:
            return super().forward(input_ids=input_ids, labels=labels, **kw)
        if self.model.context_parallel is not None:
            raise ValueError("multi-token prediction (mtp_loss_weight) does not support context parallelism")
        captured: list[torch.Tensor] = []
        handle = self.model.register_forward_hook(lambda _m, _a, out: captured.append(out[0]))
        try:
            out = super().forward(input_ids=input_ids, labels=labels, **kw)
        finally:
            handle.remove()
        assert input_ids is not None and self.model.embed_tokens is not None and self.lm_head is not None
        h = captured[0]
        masks, positions = self.model.masks(h, position_ids, document_ids, attention_mask)
        rope = self.model.rotary_emb(positions.to(h.device), h.dtype)
        labels = labels.to(h.device)
        if attention_mask is not None:
            labels = labels.masked_fill(attention_mask.to(h.device) == 0, self.ignore_index)
        docs = document_ids
        if docs is None:
            docs = document_ids_from_position_ids(positions.expand(h.shape[0], -1))
        docs = docs.to(h.device)
        total = h.new_zeros((), dtype=torch.float32)
        for k, module in enumerate(self.mtp.values(), start=1):
            target = _shift(labels, k, self.ignore_index)
            target = target.masked_fill(_shift(docs, k, -1) != docs, self.ignore_index)  # same document
            embeds = self.model.embed_tokens(_shift(input_ids.to(h.device), k, 0))
            h, block_aux = module(embeds, h, rope, masks[None])
            loss_sum = self.lm_head.loss(h, target, ignore_index=self.ignore_index, reduction="sum")
            total = total + loss_sum / (target != self.ignore_index).sum().clamp(min=1)
            if block_aux is not None:
                out["aux_loss"] = out["aux_loss"] + block_aux
        assert isinstance(self.config, DeepseekV3Config) and self.config.mtp_loss_weight is not None
        mtp = self.config.mtp_loss_weight / len(self.mtp) * total
        out["aux_loss"] = out["aux_loss"] + mtp if "aux_loss" in out else mtp
        out["mtp_loss"] = mtp.detach()
        return out

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Hugging Face's init of the model, and of the MTP modules."""
        super().reset_parameters()
        if self.mtp is not None:
            for module in self.mtp.values():
                assert isinstance(module, MultiTokenPrediction)
                module.reset_parameters(self.config.initializer_range)
