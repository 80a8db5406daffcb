"""The decoder trunk and the stage modules every family shares (causal LM, sequence classifier).

A stage module owns a contiguous range of decoder layers (kept in a ``ModuleDict`` keyed by the
global layer index, so parameter names do not depend on the split), plus the embedding on the
first stage and the final norm and head on the last. With ``num_stages=1`` it is the whole model.
Stage forwards take keyword tensors and return ``dict[str, Tensor]`` (the plait.pipelining stage
contract). A family supplies its config and a layer factory; nothing here names a family.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from plait.models.common.attention import (
    AttentionKernels,
    AttentionMask,
    ContextParallel,
    build_attention_mask,
)
from plait.models.common.config import DecoderConfig
from plait.models.common.heads import LMHead, PoolingMethod, TokenEmbedding, pool_hidden_states
from plait.models.common.layer import DecoderLayer
from plait.models.common.norm import RMSNorm
from plait.models.common.rope import RotaryEmbedding
from plait.moe import MoELayer, switch_aux_loss_from_stats
from torch import nn

__all__ = [
    "CausalLMStage",
    "DecoderStage",
    "DecoderTrunk",
    "LayerFactory",
    "SequenceClassifierStage",
    "estimate_num_parameters",
    "stage_layer_ids",
]

LayerFactory = Callable[[DecoderConfig, int], DecoderLayer]


def stage_layer_ids(num_layers: int, stage_index: int, num_stages: int) -> list[int]:
    """Layers of ``stage_index`` when ``num_layers`` are spread evenly over ``num_stages``
    (earlier stages get the remainder)."""
    if not 0 <= stage_index < num_stages:
        raise ValueError(f"stage_index {stage_index} outside [0, num_stages={num_stages})")
    if num_stages > num_layers:
        raise ValueError(f"num_stages ({num_stages}) > num_hidden_layers ({num_layers})")
    base, rem = divmod(num_layers, num_stages)
    start = stage_index * base + min(stage_index, rem)
    return list(range(start, start + base + (1 if stage_index < rem else 0)))


def estimate_num_parameters(config: DecoderConfig, layer_factory: LayerFactory) -> int:
    """Parameters of the whole model (embedding and an untied head included), counted on meta
    modules: one layer of each kind (MoE or dense, window, layer type), so that nothing is allocated and a
    config with a million layers is counted in milliseconds."""
    kinds: dict[tuple[bool, int | None, str], tuple[int, int]] = {}  # kind -> (first layer, count)
    for i in range(config.num_hidden_layers):
        key = (config.is_moe_layer(i), config.sliding_window_of(i), config.layer_type_of(i))
        first, count = kinds.get(key, (i, 0))
        kinds[key] = (first, count + 1)
    total = config.vocab_size * config.hidden_size * (1 if config.tie_word_embeddings else 2)
    total += config.hidden_size  # final norm
    with torch.device("meta"):
        for first, count in kinds.values():
            total += count * sum(p.numel() for p in layer_factory(config, first).parameters())
    return total


_OWN = "_plait_own_graph_gradient"  # set on the gradients own_pending_graph_gradients made
# (parameter, its first gradient of the step) for each gradient still in the graph trees' pool, by weak
# reference: the graph trees are one per device, so any forward with graphs may overwrite any of them.
_PENDING: list[tuple[weakref.ref[torch.Tensor], weakref.ref[torch.Tensor]]] = []


def _own_gradient(p: torch.Tensor) -> None:
    """A parameter's post-accumulate-grad hook: the first gradient of a step, left where the backward graph
    wrote it, is noted for :func:`own_pending_graph_gradients`."""
    if p.grad is not None and not getattr(p.grad, _OWN, False):
        _PENDING.append((weakref.ref(p), weakref.ref(p.grad)))


def own_pending_graph_gradients() -> None:
    """Copy each noted gradient that its parameter still holds out of the graph trees' pool.

    Called before the next replays may overwrite that pool (the trunk's forward, before it marks a new graph
    step). A gradient the optimizer step consumed and ``zero_grad`` dropped is not copied: with one
    microbatch per step no gradient is, with several only those that accumulate.
    """
    for p_ref, g_ref in _PENDING:
        p, g = p_ref(), g_ref()
        if p is not None and g is not None and p.grad is g:
            grad = g.clone()
            setattr(grad, _OWN, True)
            p.grad = grad
    _PENDING.clear()


def own_graph_gradients(layers: Iterable[nn.Module]) -> None:
    """Keep the gradients of layers replayed as CUDA graphs out of the graph trees' memory.

    A backward graph returns the layer's weight gradients in the graph trees' memory pool, and autograd
    keeps the first of a step as ``.grad`` without a copy; the next forward's replays overwrite that pool,
    so a gradient accumulated over several microbatches would be read overwritten (an error at the first
    step, wrong gradients after it: pytorch/pytorch#169545). A hook after each accumulation notes a
    gradient it did not make (once per parameter and step, after ``zero_grad`` set it to None), and
    :func:`own_pending_graph_gradients`, at the start of the next forward with graphs, replaces it by a copy
    if the parameter still holds it; later microbatches add into that copy in place. The trunk calls this
    after each layer's forward in every training forward under CUDA graphs, on the parameters the layer holds
    then (under FSDP the gathered ones, which the layer keeps until its backward): materialising a model
    built on meta (``to_empty``) or loading with ``assign`` replaces its parameters, and with them their
    hooks; parameters hooked already are skipped.
    """
    for layer in layers:
        for p in layer.parameters():
            hooks = p._post_accumulate_grad_hooks  # noqa: SLF001 (no public API; FSDP2 reads it too)
            if p.requires_grad and (hooks is None or _own_gradient not in hooks.values()):
                p.register_post_accumulate_grad_hook(_own_gradient)


def _check_graph_device(h: torch.Tensor) -> None:
    if h.device.type != "cuda":
        raise RuntimeError(f"parallel.cuda_graphs needs CUDA activations, got {h.device.type}")


def static_graph_buffers(layer: nn.Module) -> None:
    """Mark ``layer``'s buffers as inputs at fixed addresses for its CUDA graphs (once per buffer).

    Without FSDP, ``torch.compile`` treats a module's buffers so itself; it does not for a module under
    FSDP2, and a graph that updates a buffer it does not treat so (the MoE routers' load counts) is not
    captured: its forward then runs without a graph and its backward, which expects the forward's
    activations at the graph's addresses, is recorded again at every step. The trunk calls this before
    each layer's forward under CUDA graphs (materialising a meta model replaces the buffers).
    """
    for buffer in layer.buffers():
        if not hasattr(buffer, "_dynamo_static_input_type"):
            torch._dynamo.mark_static_address(buffer, guard=False)  # noqa: SLF001 (no torch.compiler name)


def _add(total: torch.Tensor | None, part: torch.Tensor | None) -> torch.Tensor | None:
    if part is None:
        return total
    return part if total is None else total + part.to(total.device)


class DecoderTrunk(nn.Module):
    """The transformer trunk of one stage: ``embed_tokens`` (first stage), ``layers``, ``norm`` (last).

    Args:
        config: Model configuration.
        layer_factory: Builds decoder layer ``i`` of the family.
        layer_ids: Global indices of the decoder layers this stage owns.
        has_embedding: Build ``embed_tokens``.
        has_norm: Build the final ``norm``.

    Attributes:
        context_parallel: Set by :func:`plait.models.parallelize` under context parallelism: the
            inputs are this rank's shard in the load-balanced layout, positions default to the
            global ones and attention crosses the context group. ``attention_mask`` (padding) is
            sharded like every other input; the mask is built from the full rows (all-gathered).
            The routers' Switch-loss statistics are already summed over the context group.
        kernels: This model's compiled attention kernels (FlexAttention), shared by its masks.
        cuda_graphs: Set by :func:`plait.models.parallelize` when the decoder layers are compiled
            into CUDA graphs (``ParallelConfig.cuda_graphs``): each forward starts a new graph
            step, and inputs off CUDA are refused. Each layer's buffers become static graph inputs
            before its forward (:func:`static_graph_buffers`), and in a training forward the parameters
            it holds after its forward get gradients of their own (:func:`own_graph_gradients`).
    """

    def __init__(
        self,
        config: DecoderConfig,
        layer_factory: LayerFactory,
        layer_ids: Sequence[int],
        has_embedding: bool,
        has_norm: bool,
    ) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = (
            TokenEmbedding(config.vocab_size, config.hidden_size, config.pad_token_id)
            if has_embedding
            else None
        )
        self.layers = nn.ModuleDict({str(i): layer_factory(config, i) for i in layer_ids})
        self.norm = (
            RMSNorm(config.hidden_size, config.rms_norm_eps, config.rms_norm_offset) if has_norm else None
        )
        self.rotary_emb = RotaryEmbedding(
            config.rope_parameters, config.rope_head_dim, config.max_position_embeddings
        )
        self.context_parallel: ContextParallel | None = None
        self.kernels = AttentionKernels()
        self.cuda_graphs = False
        # What each forward's masks depend on, fixed by the layers: one mask per distinct window (in
        # layer order, the same on every rank), built for the sinks' kernels when any layer has them.
        layers = list(self.decoder_layers())
        self._windows = tuple(dict.fromkeys(layer.sliding_window for layer in layers)) or (None,)
        self._sinks = any(layer.has_sinks for layer in layers)

    def decoder_layers(self) -> Iterator[DecoderLayer]:
        """This stage's decoder layers in order."""
        for layer in self.layers.values():
            assert isinstance(layer, DecoderLayer)
            yield layer

    def masks(
        self,
        h: torch.Tensor,
        position_ids: torch.Tensor | None,
        document_ids: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
    ) -> tuple[dict[int | None, AttentionMask], torch.Tensor]:
        """One mask per sliding window among this stage's layers, and the position ids."""
        b, s = h.shape[:2]
        common: dict[str, Any] = {
            "document_ids": document_ids,
            "attention_mask": attention_mask,
            "implementation": self.config.attn_implementation,
            "kernels": self.kernels,
            "sinks": self._sinks,
        }
        cp = self.context_parallel
        masks: dict[int | None, AttentionMask] = {}
        if cp is not None:
            for w in self._windows:
                masks[w] = cp.build_mask(
                    b, s, h.device, position_ids=position_ids, dtype=h.dtype, sliding_window=w, **common
                )
            if position_ids is None:
                position_ids = cp.local_positions(s, h.device).unsqueeze(0)
            return masks, position_ids
        for w in self._windows:
            # Default positions never restart: no need to look for packed documents in them (a host sync).
            masks[w] = build_attention_mask(
                b, s, h.device, h.dtype, position_ids=position_ids, sliding_window=w, **common
            )
        if position_ids is None:
            position_ids = torch.arange(s, device=h.device).unsqueeze(0)
        return masks, position_ids

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        hidden_states: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Run this stage's part of the trunk.

        Returns:
            ``(hidden [B, S, H], aux_loss, switch_stats)``: hidden states (normed on the last stage),
            the sum of this stage's MoE balancing losses and the sum of its routers' Switch-loss
            statistics (each None when no layer of this stage produces one).

        Args:
            input_ids: ``[B, S]`` tokens (first stage).
            hidden_states: ``[B, S, H]`` activations from the previous stage (other stages).
            position_ids: ``[B, S]`` or ``[1, S]`` positions; default ``arange(S)`` (also with
                padding, as transformers). Positions that restart inside a row mark packed
                documents (attention is masked per document).
            document_ids: ``[B, S]`` explicit document ids for packed rows.
            attention_mask: ``[B, S]`` 1 = token, 0 = padding (left or right): no token attends to
                padding, and MoE balancing losses leave padding out.
        """
        if self.embed_tokens is not None:
            if input_ids is None:
                raise ValueError("the first stage needs input_ids")
            h = self.embed_tokens(input_ids)
        else:
            if hidden_states is None:
                raise ValueError("stages after the first need hidden_states from the previous stage")
            h = hidden_states
        own_gradients = self.cuda_graphs and torch.is_grad_enabled()
        if self.cuda_graphs:
            _check_graph_device(h)
            own_pending_graph_gradients()
            # One graph step per forward: the previous step's graph outputs were consumed by its
            # backward (or were an evaluation forward's) and may be overwritten by this replay.
            torch.compiler.cudagraph_mark_step_begin()
        masks, position_ids = self.masks(h, position_ids, document_ids, attention_mask)
        rope = self.rotary_emb(position_ids.to(h.device), h.dtype)
        aux: torch.Tensor | None = None
        stats: torch.Tensor | None = None
        for layer in self.decoder_layers():
            if self.cuda_graphs:
                static_graph_buffers(layer)
            h, layer_aux, layer_stats = layer(h, rope, masks[layer.sliding_window])
            if own_gradients:  # after the layer's forward: under FSDP, the parameters it gathered
                own_graph_gradients([layer])
            aux = _add(aux, layer_aux)
            stats = _add(stats, layer_stats)
        if self.norm is not None:
            h = self.norm(h)
        return h, aux, stats

    def reset_parameters(self) -> None:
        """Hugging Face's initialisation (normal(0, initializer_range), unit norms)."""
        std = self.config.initializer_range
        if self.embed_tokens is not None:
            self.embed_tokens.reset_parameters(std)
        for layer in self.decoder_layers():
            layer.reset_parameters(std)
        if self.norm is not None:
            self.norm.reset_parameters()


class DecoderStage(nn.Module):
    """One pipeline stage of a decoder model: what the causal LM and the classifier share.

    The parallel plans (:func:`plait.models.parallelize` and the ``apply_*`` functions) take any
    subclass: they need the stage's ``config``, its :meth:`decoder_layers` and :meth:`moe_layers`.
    """

    config: DecoderConfig
    model: DecoderTrunk

    def _init_stage(
        self, config: DecoderConfig, layer_factory: LayerFactory, stage_index: int, num_stages: int
    ) -> None:
        self.config = config
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.is_first = stage_index == 0
        self.is_last = stage_index == num_stages - 1
        self.layer_ids = stage_layer_ids(config.num_hidden_layers, stage_index, num_stages)
        self.model = DecoderTrunk(config, layer_factory, self.layer_ids, self.is_first, self.is_last)

    def decoder_layers(self) -> Iterator[DecoderLayer]:
        """This stage's decoder layers in order."""
        return self.model.decoder_layers()

    def moe_layers(self) -> list[MoELayer]:
        """This stage's :class:`plait.moe.MoELayer` modules (for bias updates and load statistics)."""
        return [layer.mlp for layer in self.decoder_layers() if isinstance(layer.mlp, MoELayer)]

    @property
    def has_aux_loss(self) -> bool:
        """Whether stage outputs carry ``aux_loss`` (the model has MoE layers on any stage)."""
        return any(self.config.is_moe_layer(i) for i in range(self.config.num_hidden_layers))

    def _aux_outputs(
        self,
        h: torch.Tensor,
        own_aux: torch.Tensor | None,
        own_stats: torch.Tensor | None,
        aux_loss: torch.Tensor | None,
        router_stats: torch.Tensor | None,
    ) -> dict[str, torch.Tensor]:
        """This stage's MoE outputs: ``aux_loss``, the running sum of the per-layer losses (on the last
        stage plus the pooled Switch loss) and, on the other stages of a model that pools the Switch
        loss over its layers, ``router_stats``, the running sum of the routers' Switch statistics."""
        if not self.has_aux_loss:
            return {}
        aux = _add(_add(h.new_zeros((), dtype=torch.float32), aux_loss), own_aux)
        assert aux is not None
        stats = _add(router_stats, own_stats)
        coef = self.config.pooled_router_aux_loss_coef()
        if coef is None or stats is None:
            return {"aux_loss": aux}
        if not self.is_last:
            return {"aux_loss": aux, "router_stats": stats}
        return {"aux_loss": aux + coef * switch_aux_loss_from_stats(stats)}

    def last_aux_loss(self) -> torch.Tensor | None:
        """Sum of this stage's per-layer MoE aux losses in the last forward (detached), or None if
        none (a Switch loss pooled over all layers is not a per-layer term and is not in it)."""
        losses = [layer.last_aux_loss for layer in self.decoder_layers() if layer.last_aux_loss is not None]
        return torch.stack(losses).sum() if losses else None


class CausalLMStage(DecoderStage):
    """A family's causal LM, or one pipeline stage of it.

    Build on the meta device, then materialise and initialise::

        with torch.device("meta"):
            model = family_class(config, stage_index=0, num_stages=1)
        model.to_empty(device="cuda")
        model.reset_parameters()

    Args:
        config: The family's config.
        layer_factory: Builds the family's decoder layer ``i``.
        stage_index: This stage (0-based).
        num_stages: Number of pipeline stages (1 = the whole model).
        ignore_index: Label value that is not scored.
    """

    def __init__(
        self,
        config: DecoderConfig,
        layer_factory: LayerFactory,
        *,
        stage_index: int = 0,
        num_stages: int = 1,
        ignore_index: int = -100,
    ) -> None:
        super().__init__()
        self._init_stage(config, layer_factory, stage_index, num_stages)
        self.ignore_index = ignore_index
        self.lm_head: LMHead | None = None
        if self.is_last:
            self.lm_head = LMHead(config.hidden_size, config.vocab_size)
            if config.tie_word_embeddings:
                if not self.is_first:
                    raise ValueError(
                        "tie_word_embeddings=True needs the embedding and the head on one stage; "
                        "use num_stages=1 or an untied config for pipeline parallelism"
                    )
                assert self.model.embed_tokens is not None
                self.lm_head.weight = self.model.embed_tokens.weight

    def tie_weights(self) -> None:
        """Re-tie the head to the embedding (after something replaced either parameter)."""
        embed = self.model.embed_tokens
        if self.lm_head is None or embed is None or not self.config.tie_word_embeddings:
            return
        if self.lm_head.weight is not embed.weight:
            self.lm_head.weight = embed.weight

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        hidden_states: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        aux_loss: torch.Tensor | None = None,
        router_stats: torch.Tensor | None = None,
        return_logits: bool = False,
    ) -> dict[str, torch.Tensor]:
        """Stage forward with dict IO.

        Args:
            input_ids: ``[B, S]`` tokens (first stage).
            hidden_states: ``[B, S, H]`` from the previous stage (other stages).
            labels: ``[B, S]`` target token per position (already shifted; ``ignore_index`` to skip).
                On the last stage the loss is computed without materialising logits.
            position_ids: ``[B, S]`` positions (restarts mark packed documents); default
                ``arange(S)``, with or without padding (transformers' rule).
            document_ids: ``[B, S]`` document ids for packed rows.
            attention_mask: ``[B, S]`` transformers' padding mask (1 = token, 0 = padding, left or
                right; give it to every stage): no token attends to padding, padding positions are
                not scored (their labels count as ``ignore_index``) and MoE balancing losses leave
                them out. Logits of real tokens equal transformers' for the same padded batch.
            aux_loss: Running MoE aux loss from the previous stage (MoE models).
            router_stats: Running Switch-loss statistics from the previous stage (MoE models that
                pool the Switch loss over all layers).
            return_logits: Last stage: also return ``logits`` when ``labels`` are given.

        Returns:
            Non-last stages: ``{"hidden_states"}``. Last stage: with labels ``{"loss_sum",
            "loss", "num_tokens"}`` (sum and mean cross-entropy over scored tokens; plus
            ``"logits"`` if asked), else ``{"logits"}``. MoE models add ``"aux_loss"`` on every
            stage: on the last stage the coefficient-weighted balancing loss of the whole model
            (differentiable; add it to the objective), before it the per-layer losses so far; models
            that pool the Switch loss over their layers also return ``"router_stats"`` on non-last
            stages (the Switch statistics so far, pooled into one loss on the last stage).
        """
        h, own_aux, own_stats = self.model(
            input_ids, hidden_states, position_ids, document_ids, attention_mask
        )
        out = self._aux_outputs(h, own_aux, own_stats, aux_loss, router_stats)
        if not self.is_last:
            out["hidden_states"] = h
            return out
        assert self.lm_head is not None
        if labels is None:
            out["logits"] = self.lm_head.logits(h)
            return out
        labels = labels.to(h.device)
        if attention_mask is not None:
            labels = labels.masked_fill(attention_mask.to(h.device) == 0, self.ignore_index)
        loss_sum = self.lm_head.loss(h, labels, ignore_index=self.ignore_index, reduction="sum")
        num_tokens = (labels != self.ignore_index).sum()
        out.update(loss_sum=loss_sum, loss=loss_sum / num_tokens.clamp(min=1), num_tokens=num_tokens)
        if return_logits:
            out["logits"] = self.lm_head.logits(h)
        return out

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Initialise all parameters like Hugging Face (call after ``to_empty`` from meta).

        Re-ties the head to the embedding first when ``to_empty`` separated them.
        """
        self.tie_weights()
        self.model.reset_parameters()
        if self.lm_head is not None and not self.config.tie_word_embeddings:
            self.lm_head.reset_parameters(self.config.initializer_range)


class SequenceClassifierStage(DecoderStage):
    """A family's trunk with a ``score`` head on a pooled hidden state (HF's
    ``*ForSequenceClassification`` with ``pooling="last"``).

    Args:
        config: Model configuration.
        layer_factory: Builds the family's decoder layer ``i``.
        num_labels: Output classes (1 = regression with MSE loss).
        pooling: ``last`` (right-most non-padding token) or ``mean``.
        stage_index: This stage.
        num_stages: Number of pipeline stages.
    """

    def __init__(
        self,
        config: DecoderConfig,
        layer_factory: LayerFactory,
        num_labels: int,
        *,
        pooling: PoolingMethod = "last",
        stage_index: int = 0,
        num_stages: int = 1,
    ) -> None:
        super().__init__()
        self._init_stage(config, layer_factory, stage_index, num_stages)
        self.num_labels = num_labels
        self.pooling: PoolingMethod = pooling
        self.score = nn.Linear(config.hidden_size, num_labels, bias=False) if self.is_last else None

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        hidden_states: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        aux_loss: torch.Tensor | None = None,
        router_stats: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """Stage forward; the last stage returns ``{"logits" [B, num_labels]}`` (+ ``"loss"`` with labels).

        ``attention_mask [B, S]`` (1 = token, 0 = padding) masks attention like transformers and
        selects the pooled tokens; with no mask and a ``pad_token_id`` in the config, the pooled
        tokens are found from ``input_ids`` like HF (attention then sees every token, as in HF).
        MoE outputs (``aux_loss``, ``router_stats``) as in :meth:`CausalLMStage.forward`.
        """
        h, own_aux, own_stats = self.model(
            input_ids, hidden_states, position_ids, attention_mask=attention_mask
        )
        out = self._aux_outputs(h, own_aux, own_stats, aux_loss, router_stats)
        if not self.is_last:
            out["hidden_states"] = h
            return out
        assert self.score is not None
        if attention_mask is None and input_ids is not None and self.config.pad_token_id is not None:
            attention_mask = (input_ids != self.config.pad_token_id).long()
        logits = self.score(pool_hidden_states(h, self.pooling, attention_mask=attention_mask))
        out["logits"] = logits
        if labels is not None:
            if self.num_labels == 1:
                out["loss"] = nn.functional.mse_loss(logits.squeeze(-1), labels.to(logits.dtype))
            else:
                out["loss"] = nn.functional.cross_entropy(logits, labels)
        return out

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Initialise like Hugging Face."""
        self.model.reset_parameters()
        if self.score is not None:
            nn.init.normal_(self.score.weight, 0.0, self.config.initializer_range)
