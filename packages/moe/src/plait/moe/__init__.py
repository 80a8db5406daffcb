"""plait.moe: Mixture-of-Experts: routers with load balancing, grouped experts, expert-parallel token dispatch."""

from plait.moe.aux_grad import attach_aux_loss
from plait.moe.balancing import expert_load_stats, register_expert_bias_hook, update_expert_biases
from plait.moe.capacity import apply_capacity, expert_capacity
from plait.moe.config import ClampedSwiGLU, ExpertActivation, RouterConfig, SwiGLU
from plait.moe.dispatch import (
    AllGatherDispatcher,
    AllToAllDispatcher,
    DeepEPDispatcher,
    LocalDispatcher,
    TokenDispatcher,
    all_to_all,
)
from plait.moe.experts import ExpertAdapter, GroupedExperts, SharedExpert, clamped_swiglu, row_experts
from plait.moe.layer import MoELayer, MoEOutput
from plait.moe.layout import (
    deinterleave_halves,
    down_from_input_major,
    down_to_input_major,
    gate_up_bias_from_interleaved,
    gate_up_bias_to_interleaved,
    gate_up_from_input_major_interleaved,
    gate_up_to_input_major_interleaved,
    interleave_halves,
    interleaved_order,
)
from plait.moe.losses import (
    router_z_loss,
    seq_aux_loss,
    switch_aux_loss,
    switch_aux_loss_from_stats,
    switch_loss_stats,
)
from plait.moe.parallel import ExpertDispatch, expert_parallel
from plait.moe.router import RouterOutput, TopKRouter

__all__ = [
    "AllGatherDispatcher",
    "AllToAllDispatcher",
    "ClampedSwiGLU",
    "DeepEPDispatcher",
    "ExpertActivation",
    "ExpertAdapter",
    "ExpertDispatch",
    "GroupedExperts",
    "LocalDispatcher",
    "MoELayer",
    "MoEOutput",
    "RouterConfig",
    "RouterOutput",
    "SharedExpert",
    "SwiGLU",
    "TokenDispatcher",
    "TopKRouter",
    "all_to_all",
    "apply_capacity",
    "attach_aux_loss",
    "clamped_swiglu",
    "deinterleave_halves",
    "down_from_input_major",
    "down_to_input_major",
    "expert_capacity",
    "expert_load_stats",
    "expert_parallel",
    "gate_up_bias_from_interleaved",
    "gate_up_bias_to_interleaved",
    "gate_up_from_input_major_interleaved",
    "gate_up_to_input_major_interleaved",
    "interleave_halves",
    "interleaved_order",
    "register_expert_bias_hook",
    "router_z_loss",
    "row_experts",
    "seq_aux_loss",
    "switch_aux_loss",
    "switch_aux_loss_from_stats",
    "switch_loss_stats",
    "update_expert_biases",
]
