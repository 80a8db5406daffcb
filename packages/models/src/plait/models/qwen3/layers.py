"""Qwen3 / Qwen3-MoE decoder layer."""

from __future__ import annotations

import torch
from plait.models.blocks.attention import AttentionMask, GroupedQueryAttention
from plait.models.blocks.mlp import SwiGLUMLP
from plait.models.blocks.norm import RMSNorm
from plait.models.config import Qwen3Config, Qwen3MoeConfig
from torch import nn

__all__ = ["Qwen3DecoderLayer"]


def _moe_layer(config: Qwen3MoeConfig) -> nn.Module:
    from plait.moe import MoELayer, RouterConfig

    router = RouterConfig(
        score_func="softmax",
        top_k=config.num_experts_per_tok,
        norm_topk_prob=config.norm_topk_prob,
        aux_loss_coef=config.router_aux_loss_coef,
        aux_loss_pooling=config.router_aux_loss_pooling,
    )
    return MoELayer(config.hidden_size, config.moe_intermediate_size, config.num_experts, router)


class Qwen3DecoderLayer(nn.Module):
    """Pre-norm decoder layer: ``h += attn(norm(h)); h += mlp(norm(h))``; the mlp is a SwiGLU MLP
    or a :class:`plait.moe.MoELayer` following ``config.is_moe_layer(layer_idx)``.

    Parameter names follow Hugging Face (``self_attn.q_proj``, ``mlp.gate_proj``, ...) except the
    MoE block, which keeps plait.moe's names (``mlp.router.weight``, ``mlp.experts.gate_up_proj``).

    Attributes:
        last_aux_loss: Detached aux loss of the last forward (MoE layers; None otherwise).
        last_tokens_per_expert: Expert loads of the last forward (MoE layers; None otherwise).
    """

    def __init__(self, config: Qwen3Config, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.is_moe = config.is_moe_layer(layer_idx)
        self.self_attn = GroupedQueryAttention(
            config.hidden_size,
            config.num_attention_heads,
            config.kv_heads,
            config.resolved_head_dim,
            config.attention_bias,
            config.rms_norm_eps,
        )
        self.mlp: nn.Module
        if self.is_moe:
            assert isinstance(config, Qwen3MoeConfig)
            self.mlp = _moe_layer(config)
        else:
            self.mlp = SwiGLUMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.last_aux_loss: torch.Tensor | None = None
        self.last_tokens_per_expert: torch.Tensor | None = None

    def forward(
        self, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: AttentionMask
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """``hidden [B, S, H]`` -> ``(hidden [B, S, H], aux_loss, switch_stats)``: the MoE block's
        coefficient-weighted balancing loss and its Switch-loss statistics (to pool over layers with
        ``router_aux_loss_pooling="all_layers"``); None for dense layers. Padding tokens
        (``mask.padding_mask``) are left out of both."""
        attn = self.self_attn(self.input_layernorm(hidden), rope, mask)
        x, hidden = self.post_attention_layernorm.forward_residual(attn, hidden)
        if not self.is_moe:
            return hidden + self.mlp(x), None, None
        out = self.mlp(x, mask.padding_mask)
        self.last_aux_loss = out.aux_loss.detach()
        self.last_tokens_per_expert = out.tokens_per_expert
        return hidden + out.hidden_states, out.aux_loss, out.switch_stats

    def reset_parameters(self, std: float) -> None:
        """Hugging Face's init: normal(0, std) for projections, router and experts; unit norms."""
        self.self_attn.reset_parameters(std)
        if self.is_moe:
            for name, p in self.mlp.named_parameters():
                if name.endswith("bias"):
                    nn.init.zeros_(p)
                else:
                    nn.init.normal_(p, 0.0, std)
            for name, b in self.mlp.named_buffers():
                if name.endswith("expert_bias"):
                    b.zero_()
        else:
            assert isinstance(self.mlp, SwiGLUMLP)
            self.mlp.reset_parameters(std)
        self.input_layernorm.reset_parameters()
        self.post_attention_layernorm.reset_parameters()
