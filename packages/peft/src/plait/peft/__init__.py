"""plait.peft: parameter-efficient fine-tuning.

LoRA/DoRA for ``nn.Linear``, per-expert LoRA for grouped-expert weights, full-tune by regex, method
stacking (pydantic discriminated union), merge/unmerge (plain and DTensor parameters), adapter
IO (safetensors) and Hugging Face PEFT adapter export/import.
"""

from plait.peft.apply import (
    AdaptedModule,
    PeftApplier,
    PeftReport,
    apply_peft,
    canonical_name,
    expert_adapters,
    linear_adapters,
    merge_and_unload,
    merge_peft,
    register_peft_method,
    shard_expert_adapters,
    trainable_parameters,
    unmerge_peft,
)
from plait.peft.config import (
    DoRAConfig,
    FullTuneConfig,
    LoRAConfig,
    LoRAInit,
    PeftConfig,
    PeftStackConfig,
    Targets,
    matches,
)
from plait.peft.experts import (
    ExpertAdapterHost,
    ExpertLoRA,
    GroupedMM,
    attach_expert_adapter,
    detach_expert_adapters,
    expert_adapters_of,
    grouped_mm,
)
from plait.peft.hf import ExpertOutOrder, export_hf_adapter, import_hf_adapter
from plait.peft.io import load_adapter, read_adapter_config, save_adapter
from plait.peft.lora import DoRALinear, LoRALinear
from plait.peft.mappers import BaseKeyRename, adapter_keys, base_to_injected, load_base_checkpoint

__all__ = [
    "AdaptedModule",
    "BaseKeyRename",
    "DoRAConfig",
    "DoRALinear",
    "ExpertAdapterHost",
    "ExpertLoRA",
    "ExpertOutOrder",
    "FullTuneConfig",
    "GroupedMM",
    "LoRAConfig",
    "LoRAInit",
    "LoRALinear",
    "PeftApplier",
    "PeftConfig",
    "PeftReport",
    "PeftStackConfig",
    "Targets",
    "adapter_keys",
    "apply_peft",
    "attach_expert_adapter",
    "base_to_injected",
    "canonical_name",
    "detach_expert_adapters",
    "expert_adapters",
    "expert_adapters_of",
    "export_hf_adapter",
    "grouped_mm",
    "import_hf_adapter",
    "linear_adapters",
    "load_adapter",
    "load_base_checkpoint",
    "matches",
    "merge_and_unload",
    "merge_peft",
    "read_adapter_config",
    "register_peft_method",
    "save_adapter",
    "shard_expert_adapters",
    "trainable_parameters",
    "unmerge_peft",
]
