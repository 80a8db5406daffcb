"""A model provider for training loops, for every family (satisfies ``plait.loop.ModelProvider``)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from plait.dist_core import DistributedContext, init_as_one_process
from plait.model_state import materialize
from plait.models.common.config import DecoderConfig
from plait.models.common.model import CausalLMStage
from plait.models.common.parallel import ParallelConfig, precompute_float8_scales
from plait.models.flops import flops_per_token
from plait.models.hf import build_causal_lm, load_hf_checkpoint, save_hf_checkpoint
from plait.models.plan import parallelize
from plait.moe import MoELayer, update_expert_biases
from torch import nn

__all__ = ["CausalLMProvider"]


class CausalLMProvider:
    """Builds, parallelises, initialises and (optionally) loads causal-LM stages of any family.

    Args:
        config: Model config of any registered family (its ``model_type`` picks the family).
        parallel: Parallel plan settings (FSDP/HSDP, checkpointing, compile).
        init_from: Optional Hugging Face checkpoint directory loaded by :meth:`load_initial_weights`.
        dtype: Parameter dtype after materialisation (default fp32; FSDP mixed precision is set in
            ``parallel``).
        seed: Seed for ``reset_parameters`` (the same on every rank).
    """

    def __init__(
        self,
        config: DecoderConfig,
        *,
        parallel: ParallelConfig | None = None,
        init_from: str | os.PathLike[str] | None = None,
        dtype: torch.dtype | None = None,
        seed: int = 0,
    ) -> None:
        self.config = config
        self.parallel = parallel or ParallelConfig()
        self.init_from = Path(init_from) if init_from is not None else None
        self.dtype = dtype
        self.seed = seed

    def build_stage(self, stage_index: int, num_stages: int) -> CausalLMStage:
        """Stage ``stage_index`` of ``num_stages`` on the meta device."""
        with torch.device("meta"):
            model = build_causal_lm(self.config, stage_index=stage_index, num_stages=num_stages)
        if self.dtype is not None:
            model.to(self.dtype)
        return model

    def parallelize(
        self, module: nn.Module, ctx: DistributedContext | None, config: object = None
    ) -> nn.Module:
        """Float8 / TP / EP / checkpointing / compile / FSDP from ``ctx`` (None = a single process: the
        plan's float8, checkpointing and compile only).

        ``config`` (the loop's trainer config) is not read: the plan comes from ``parallel``.
        """
        del config
        assert isinstance(module, CausalLMStage)
        return parallelize(module, context=ctx, config=self.parallel)

    def materialize(self, module: nn.Module, device: torch.device | str) -> None:
        """Allocate on ``device`` (tied weights stay tied) and initialise (seeded, so every rank draws
        the same numbers; on a CPU mesh each rank keeps its part of one process's values:
        :func:`plait.dist_core.init_as_one_process`)."""
        assert isinstance(module, CausalLMStage)
        materialize(module, device)
        # manual_seed seeds every device: fork the CUDA generator too, so that the caller's CUDA stream
        # of random numbers is left as it was (sharded and plain inits advance it by different amounts).
        dev = torch.device(device)
        cuda = (
            [dev.index if dev.index is not None else torch.cuda.current_device()]
            if dev.type == "cuda"
            else []
        )
        with torch.random.fork_rng(devices=cuda):
            torch.manual_seed(self.seed + module.stage_index)
            init_as_one_process(module, module.reset_parameters)

    def load_initial_weights(self, modules: Sequence[nn.Module]) -> None:
        """Load ``init_from`` (a Hugging Face checkpoint) into the local stages, if set."""
        if self.init_from is not None and modules:
            load_hf_checkpoint(list(modules), self.init_from)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token of the whole model."""
        return flops_per_token(self.config, seq_len)

    def export_hf(self, modules: Sequence[nn.Module], out_dir: str | os.PathLike[str], **kwargs: Any) -> Path:
        """Export the local stages as a Hugging Face checkpoint (collective; see :func:`save_hf_checkpoint`)."""
        return save_hf_checkpoint(list(modules), out_dir, **kwargs)

    def after_optimizer_step(self, modules: Sequence[nn.Module], ctx: DistributedContext | None) -> None:
        """What follows every optimizer step (``plait.loop.Trainer`` calls it): the float8 scales of
        FSDP-sharded ``tensorwise`` weights for the next all-gather (``parallel.float8``), then
        auxiliary-loss-free balancing (:meth:`balance_experts`)."""
        if self.parallel.float8.recipe == "tensorwise":
            precompute_float8_scales(modules)
        self.balance_experts(modules, ctx)

    @staticmethod
    def balance_experts(modules: Sequence[nn.Module], ctx: DistributedContext | None) -> None:
        """Auxiliary-loss-free balancing: every router with a ``bias_update_rate`` moves its expert
        bias by the sign of the step's load against the mean, the integer token counts summed over the batch mesh's data and context
        ranks (``dp x cp``: every replica of this stage's routers, the expert-parallel ranks among
        them; pipeline ranks hold other layers, tensor ranks the same tokens). Every replica then
        applies the same update, bit for bit. Routers without a rate are left alone (no collective)."""
        moe = CausalLMProvider.moe_layers(modules)
        if not any(isinstance(m, MoELayer) and m.router.config.bias_update_rate is not None for m in moe):
            return
        group = None
        if ctx is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            group = ctx.mesh_for("batch")["dp", "cp"]
        for m in modules:
            update_expert_biases(m, group)

    @staticmethod
    def moe_layers(modules: Sequence[nn.Module]) -> list[nn.Module]:
        """All :class:`plait.moe.MoELayer` modules of the local stages (bias updates, load stats)."""
        out: list[nn.Module] = []
        for m in modules:
            if isinstance(m, CausalLMStage):
                out.extend(m.moe_layers())
        return out
