"""The models ``throughput.py`` trains: one small entry per model family, and the targets it reports.

A ``Workload`` is a Hugging Face config dict (what transformers, plait and torchtitan are built from), a
batch, the transformers class, a torchtitan builder and the implementations that run. Adding a family
is adding an entry to ``WORKLOADS`` (and, for torchtitan, a builder below).

plait's rows build every family through ``plait.models.CausalLMProvider(config_from_hf(hf_config))``.
The large families run with fewer layers than their namesakes, so that AdamW fits one H100.
"""

from __future__ import annotations

import copy
import importlib
import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful

COMPILED = ("hf_compiled", "torchtitan_compiled", "plait_step_compiled")
# ...and plait's step with float8 linears (``ParallelConfig.float8``; throughput.py --fp8-recipe).
COMPILED_FP8 = (*COMPILED, "plait_step_fp8_compiled")
ALL_1GPU = (
    "hf_eager", "hf_compiled", "torchtitan_eager", "torchtitan_compiled",
    "plait_step_eager", "plait_step_compiled", "plait_trainer_eager", "plait_trainer_compiled",
    "plait_trainer_no_graphs",
)  # fmt: skip


@dataclass(frozen=True)
class Workload:
    """One model shape and batch, trained by each implementation in ``impls``.

    Attributes:
        name: Row-name prefix (``dense.hf_compiled``) and the first part of the rows' ``id``.
        title: What the results table calls it.
        hf_config: Hugging Face ``config.json`` fields, ``model_type`` included.
        hf_class: The transformers class of the ``hf_*`` rows.
        titan: Builds torchtitan's model on the meta device from ``(hf_config, seq)``; None: no such rows.
        batch: Sequences per GPU.
        seq: Tokens per sequence.
        impls: The rows of this workload (``ALL_1GPU`` names; the Trainer rows need the MoE main job).
        hf_extra: Config fields only transformers reads (router logits, sparse steps).
        hf_kwargs: Keyword arguments of ``_from_config`` (e.g. the experts' implementation).
        smoke: Overrides of ``hf_config`` for ``--smoke`` (a tiny model on the CPU).
    """

    name: str
    title: str
    hf_config: dict[str, Any]
    hf_class: str
    titan: Callable[[dict[str, Any], int], nn.Module] | None
    batch: int
    seq: int
    impls: tuple[str, ...]
    hf_extra: dict[str, Any] = field(default_factory=dict)
    hf_kwargs: dict[str, Any] = field(default_factory=dict)
    smoke: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Target:
    """A ratio the benchmark is held to: ``row`` against ``baseline`` of one workload, in one run."""

    label: str
    workload: str
    row: str
    baseline: str
    want: float
    memory: bool = False  # True: peak GiB ratio, at most ``want``; False: tok/s ratio, at least ``want``

    def verdict(self, results: dict[str, dict[str, Any]]) -> str:
        """One line: the measured ratio, the target and MET / MISSED (or why it was not measured)."""
        row, base = (
            results.get(f"{self.workload}.{self.row}"),
            results.get(f"{self.workload}.{self.baseline}"),
        )
        what = f"{self.label}: {self.row}/{self.baseline}"
        if not row or not base or "skipped" in row or "skipped" in base:
            return f"{what} (target {'<=' if self.memory else '>='} {self.want}x): NOT MEASURED"
        key = "peak_gib" if self.memory else "tok_s_per_gpu"
        ratio = row[key] / base[key]
        met = ratio <= self.want if self.memory else ratio >= self.want
        unit = "memory" if self.memory else "tok/s"
        sign = "<=" if self.memory else ">="
        return f"{what} {unit} = {ratio:.2f}x (target {sign} {self.want}x): {'MET' if met else 'MISSED'}"


# ------------------------------------------------------------------ torchtitan
class _StubType(type(Stateful)):  # type: ignore[misc]
    """The type of stub classes: any attribute of a stub class is another stub class.

    Derived from the metaclass of torch's ``Stateful`` protocol (an ``ABCMeta``), so that a class with a
    stub base and a ``Stateful`` or ABC base (torchtitan's data loader) can be created.
    """

    def __getattr__(cls, attr: str) -> Any:
        if attr.startswith("_"):
            raise AttributeError(attr)
        return _stub_class(f"{cls.__qualname__}.{attr}", cls.__module__)


class _Stub(metaclass=_StubType):
    """Base of stub classes: usable as a base class, an annotation, a decorator or a call."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return args[0] if len(args) == 1 and callable(args[0]) and not kwargs else self  # a decorator

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("_"):
            raise AttributeError(attr)
        return _stub_class(attr, type(self).__module__)()


def _stub_class(name: str, module: str) -> type:
    return _StubType(name, (_Stub,), {"__module__": module, "__qualname__": name})


class _StubModule(types.ModuleType):
    """A module torchtitan imports but its model code never calls: any attribute is a stub class."""

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):  # inspect and importlib probe dunders: behave like a plain module
            raise AttributeError(attr)
        return _stub_class(attr, self.__name__)


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports of ``roots`` and every submodule of them (``datasets.distributed``) give stub modules."""

    def __init__(self, roots: Sequence[str]) -> None:
        self.roots = tuple(roots)

    def find_spec(
        self, fullname: str, path: Any = None, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        if any(fullname == r or fullname.startswith(r + ".") for r in self.roots):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


# What torchtitan 0.2.2's packages import at module level for data loading, tokenizers, configs and loggers.
TORCHTITAN_OPTIONAL = (
    "datasets", "torchdata", "tokenizers", "tiktoken", "blobfile", "wandb", "tensorboard",
    "torch.utils.tensorboard", "tyro", "tomli", "huggingface_hub",
)  # fmt: skip


def stub_missing_modules(names: Sequence[str] = TORCHTITAN_OPTIONAL) -> list[str]:
    """Make each of ``names`` that cannot be imported, and all its submodules, a stub; returns those stubbed.

    torchtitan's model code never calls them, but its package imports them (``datasets.distributed``
    among them), so a missing one would stop the import of the model.
    """
    missing = []
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
            for mod in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
                del sys.modules[mod]  # a half-imported package
    if missing:
        sys.meta_path.insert(0, _StubFinder(missing))
    return missing


def _moe_args(hf: dict[str, Any], use_grouped_mm: bool) -> Any:
    from torchtitan.models.moe import MoEArgs

    return MoEArgs(
        num_experts=hf["num_experts"], num_shared_experts=0, top_k=hf["num_experts_per_tok"],
        score_func="softmax", route_norm=hf.get("norm_topk_prob", True), score_before_experts=False,
        use_grouped_mm=use_grouped_mm,
    )  # fmt: skip


def titan_qwen3(hf: dict[str, Any], seq: int) -> nn.Module:
    """torchtitan's Qwen3 (dense, or MoE when ``hf`` has experts) with ``hf``'s shapes, on meta."""
    from torchtitan.models.qwen3.model.args import Qwen3ModelArgs
    from torchtitan.models.qwen3.model.model import Qwen3Model

    moe: dict[str, Any] = {}
    if "num_experts" in hf:
        moe = {"moe_enabled": True, "moe_inter_dim": hf["moe_intermediate_size"],
               "moe_args": _moe_args(hf, torch.cuda.is_available())}  # fmt: skip
    args = Qwen3ModelArgs(
        dim=hf["hidden_size"], n_layers=hf["num_hidden_layers"], n_heads=hf["num_attention_heads"],
        n_kv_heads=hf["num_key_value_heads"], vocab_size=hf["vocab_size"], head_dim=hf["head_dim"],
        hidden_dim=hf["intermediate_size"], max_seq_len=seq, qk_norm=True, **moe,
    )  # fmt: skip
    with torch.device("meta"):
        return Qwen3Model(args)


def titan_llama3(hf: dict[str, Any], seq: int) -> nn.Module:
    """torchtitan's Llama 3 with ``hf``'s shapes, on meta (the 8B flavour's FFN rule: 14336 from 4096)."""
    from torchtitan.models.llama3.model.args import TransformerModelArgs
    from torchtitan.models.llama3.model.model import Transformer

    args = TransformerModelArgs(
        dim=hf["hidden_size"], n_layers=hf["num_hidden_layers"], n_heads=hf["num_attention_heads"],
        n_kv_heads=hf["num_key_value_heads"], vocab_size=hf["vocab_size"], multiple_of=1024,
        ffn_dim_multiplier=1.3, rope_theta=hf["rope_theta"], max_seq_len=seq,
    )  # fmt: skip  # torchtitan's "8B" flavour: hidden 14336 from dim 4096
    with torch.device("meta"):
        return Transformer(args)


def titan_flavour(module: str, flavour: str) -> Callable[[dict[str, Any], int], nn.Module]:
    """A builder of one of torchtitan's registered flavours (torchtitan 0.2.2's ``get_train_spec()``)
    with ``hf``'s layer count and the run's sequence length; the other shapes are the flavour's."""

    def build(hf: dict[str, Any], seq: int) -> nn.Module:
        spec = importlib.import_module(f"torchtitan.models.{module}").get_train_spec()
        args = copy.deepcopy(spec.model_args[flavour])
        args.n_layers = hf["num_hidden_layers"]
        args.max_seq_len = seq
        if getattr(args, "attn_mask_type", "causal") != "causal":
            args.attn_mask_type = "causal"  # the rows train on unpacked rows, as the other implementations
        with torch.device("meta"):
            return spec.model_cls(args)

    return build


# ------------------------------------------------------------------ the entries
QWEN3_MOE_1B = {  # 8 layers, 64 experts top-8, expert FFN 512: 1.14B parameters
    "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072,
    "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 64,
    "max_position_embeddings": 4096, "moe_intermediate_size": 512, "num_experts": 64,
    "num_experts_per_tok": 8, "norm_topk_prob": True, "router_aux_loss_coef": 0.001,
    "tie_word_embeddings": False,
}  # fmt: skip
QWEN3_1_7B = {  # Qwen3-1.7B's shapes (untied here, like the peers' torchtitan model)
    "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
    "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
    "max_position_embeddings": 40960, "rope_theta": 1000000.0, "tie_word_embeddings": False,
}  # fmt: skip
LLAMA3_8B = {  # Llama-3-8B's layer, 8 of its 32 layers
    "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 8, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "max_position_embeddings": 8192, "rope_theta": 500000.0, "tie_word_embeddings": False,
}  # fmt: skip
GPT_OSS_20B = {  # gpt-oss-20b's layers, 4 of its 24 (2 sliding-window, 2 full)
    "model_type": "gpt_oss", "vocab_size": 201088, "hidden_size": 2880, "intermediate_size": 2880,
    "num_hidden_layers": 4, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
    "num_local_experts": 32, "num_experts_per_tok": 4, "sliding_window": 128,
    "max_position_embeddings": 131072, "rope_theta": 150000.0, "tie_word_embeddings": False,
}  # fmt: skip
DEEPSEEK_V3_16B = {  # torchtitan's deepseek_v3 "16B" layers, 6 of its 27 (1 dense + 5 MoE)
    "model_type": "deepseek_v3", "vocab_size": 102400, "hidden_size": 2048, "intermediate_size": 10944,
    "moe_intermediate_size": 1408, "num_hidden_layers": 6, "first_k_dense_replace": 1,
    "num_attention_heads": 16, "num_key_value_heads": 16, "n_routed_experts": 64, "n_shared_experts": 2,
    "num_experts_per_tok": 6, "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "max_position_embeddings": 4096, "tie_word_embeddings": False,
}  # fmt: skip
# Qwen3.5-9B's text model shapes (hidden 4096, 16 query / 4 KV heads of 256, gated DeltaNet with 16 key / 32
# value heads of 128, FFN 12288, vocab 248320), 4 of its 32 layers: three gated-DeltaNet layers and one gated
# full-attention layer, its repeating unit. plait runs fla's kernels (the extra plait-models[fla]), as
# transformers does when fla is installed.
QWEN3_5_9B = {
    "model_type": "qwen3_5_text", "vocab_size": 248320, "hidden_size": 4096, "intermediate_size": 12288,
    "num_hidden_layers": 4, "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 256,
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    "max_position_embeddings": 32768, "tie_word_embeddings": False, "linear_attn_implementation": "auto",
}  # fmt: skip
_TINY = {"vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16}  # fmt: skip

WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload(
            name="moe",
            title="Qwen3-MoE 1.14B (8 layers, hidden 1024, 64 experts top-8, expert FFN 512, vocab 151936), 4 x 2048",
            hf_config=QWEN3_MOE_1B,
            hf_class="Qwen3MoeForCausalLM",
            titan=titan_qwen3,
            batch=4,
            seq=2048,
            impls=ALL_1GPU,
            hf_extra={"decoder_sparse_step": 1, "mlp_only_layers": [], "output_router_logits": True},
            hf_kwargs={"experts_implementation": "grouped_mm"},
            smoke={**_TINY, "moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2},
        ),
        Workload(
            name="dense",
            title="Qwen3 1.7B shapes (28 layers, hidden 2048, FFN 6144, vocab 151936), 2 x 4096, compiled",
            hf_config=QWEN3_1_7B,
            hf_class="Qwen3ForCausalLM",
            titan=titan_qwen3,
            batch=2,
            seq=4096,
            impls=COMPILED_FP8,
            smoke={**_TINY, "intermediate_size": 128},
        ),
        Workload(
            name="llama3_8b",
            title="Llama-3-8B shapes, 8 of 32 layers, 1 x 4096, compiled",
            hf_config=LLAMA3_8B,
            hf_class="LlamaForCausalLM",
            titan=titan_llama3,
            batch=1,
            seq=4096,
            impls=COMPILED_FP8,
            smoke={**_TINY, "intermediate_size": 128},
        ),
        Workload(
            name="qwen3_5",
            title="Qwen3.5-9B shapes, 4 of 32 layers (3 gated DeltaNet, 1 gated attention), 1 x 4096, compiled",
            hf_config=QWEN3_5_9B,
            hf_class="Qwen3_5ForCausalLM",
            titan=None,
            batch=1,
            seq=4096,
            impls=("hf_compiled", "plait_step_compiled"),
            smoke={
                **_TINY,
                "intermediate_size": 128,
                "linear_num_key_heads": 2,
                "linear_num_value_heads": 4,
                "linear_key_head_dim": 16,
                "linear_value_head_dim": 16,
                "layer_types": ["linear_attention", "full_attention"],
            },
        ),
        Workload(
            name="gpt_oss_20b",
            title="gpt-oss-20b shapes, 4 of 24 layers, 1 x 4096, compiled",
            hf_config=GPT_OSS_20B,
            hf_class="GptOssForCausalLM",
            titan=titan_flavour("gpt_oss", "20b"),
            batch=1,
            seq=4096,
            impls=COMPILED,
            # transformers' gpt-oss has no SDPA path (sinks): FlexAttention on GPUs, eager on the CPU.
            hf_kwargs={
                "experts_implementation": "grouped_mm",
                "attn_implementation": "flex_attention" if torch.cuda.is_available() else "eager",
            },
            smoke={**_TINY, "intermediate_size": 64, "num_local_experts": 4, "num_experts_per_tok": 2},
        ),
        Workload(
            name="deepseek_v3_16b",
            title="DeepSeek-V3 16B shapes, 6 of 27 layers, 1 x 4096, compiled",
            hf_config=DEEPSEEK_V3_16B,
            hf_class="DeepseekV3ForCausalLM",
            titan=titan_flavour("deepseek_v3", "16B"),
            batch=1,
            seq=4096,
            impls=COMPILED,
            hf_kwargs={"experts_implementation": "grouped_mm"},
            smoke={
                **_TINY,
                "intermediate_size": 128,
                "moe_intermediate_size": 32,
                "n_routed_experts": 8,
                "num_experts_per_tok": 2,
                "kv_lora_rank": 16,
                "qk_nope_head_dim": 16,
                "qk_rope_head_dim": 8,
                "v_head_dim": 16,
                "num_key_value_heads": 4,
            },
        ),
    )
}
# The workloads every plain run measures (the others wait for the family-neutral provider).
DEFAULT_WORKLOADS = ("moe", "dense")

TARGETS = (
    Target("MoE", "moe", "plait_trainer_compiled", "hf_compiled", 1.3),
    Target("MoE", "moe", "plait_trainer_compiled", "hf_compiled", 0.7, memory=True),
    Target("Trainer overhead", "moe", "plait_trainer_compiled", "plait_step_compiled", 0.95),
    Target("Dense Qwen3 1.7B", "dense", "plait_step_compiled", "torchtitan_compiled", 1.15),
    Target("Dense Qwen3 1.7B FP8", "dense", "plait_step_fp8_compiled", "torchtitan_compiled", 1.3),
)
