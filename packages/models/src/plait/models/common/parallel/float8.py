"""FP8 training of a decoder stage's linear layers with torchao float8 (:class:`Float8Training`).

The conversion swaps each selected ``nn.Linear`` for torchao's ``Float8Linear`` (same parameter
names, so checkpoints and mappers are unchanged): its GEMMs cast their operands to float8 with
dynamic scales (per tensor or per row) and run on the float8 tensor cores. It is applied to the
meta-device stage before tensor parallelism, as torchtitan does, so that the tensor-parallel plan's
hooks and DTensor weights belong to the converted modules.

With ``Float8Training.experts`` the routed experts' grouped GEMMs run in float8 too: each
:class:`~plait.moe.GroupedExperts` gets :func:`float8_grouped_mm` as its ``grouped_mm``, which pads
every expert's rows to a multiple of 16 (what the float8 grouped GEMM needs, for the weight
gradient's token-dimension groups) and calls torchao's differentiable rowwise float8 grouped GEMM
(``torchao.prototype.moe_training``): both operands cast with power-of-two rowwise scales, the same
for the two backward GEMMs.

Not converted: the embedding, the LM head and routers (kept in high precision).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from types import ModuleType

import torch
from plait.models.common.model import DecoderStage
from plait.models.common.parallel.config import Float8Training
from plait.moe import GroupedExperts
from plait.moe.experts import row_experts
from torch import Tensor, nn

__all__ = [
    "Float8Conversion",
    "aligned_rows",
    "apply_float8",
    "check_float8",
    "float8_grouped_mm",
    "float8_linears",
    "precompute_float8_scales",
]

logger = logging.getLogger(__name__)

_MIN_CAPABILITY = (8, 9)
_INSTALL = 'pip install "plait-models[float8]"'


@dataclass(frozen=True)
class Float8Conversion:
    """The linears of a stage that float8 training converts and those it keeps in high precision.

    Attributes:
        converted: Module names (as in ``stage.named_modules()``) converted to ``Float8Linear``, and
            the routed experts given :func:`float8_grouped_mm` (``Float8Training.experts``).
        skipped: ``(name, reason)`` of the decoder-layer linears (and experts) kept in high precision.
    """

    converted: tuple[str, ...]
    skipped: tuple[tuple[str, str], ...]


def _torchao_float8() -> ModuleType:
    try:
        import torchao.float8 as float8
    except ImportError as e:
        raise ImportError(f"parallel.float8 needs torchao, which is not installed: {_INSTALL}") from e
    return float8


def _torchao_grouped_mm() -> None:
    try:
        from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm  # noqa: F401
    except ImportError as e:
        raise ImportError(
            "parallel.float8.experts needs torchao's float8 grouped GEMM (torchao.prototype.moe_training, "
            f"torchao >= 0.17): {_INSTALL}"
        ) from e


def check_float8(config: Float8Training) -> None:
    """Whether ``config`` can run here: torchao installed, and float8 GEMMs on this machine's GPU
    (unless ``config.emulate``). Nothing to check when float8 is off.

    Raises:
        ImportError: torchao is not installed (names the ``plait-models[float8]`` extra).
        RuntimeError: no CUDA device, or one below compute capability 8.9 (Ada, Hopper, Blackwell).
    """
    if config.recipe is None:
        return
    _torchao_float8()
    if config.emulate:
        return
    hint = "(parallel.float8.emulate = true runs emulated float8 GEMMs for tests, with no speed-up)"
    if not torch.cuda.is_available():
        raise RuntimeError(
            "parallel.float8 needs an NVIDIA GPU of compute capability 8.9+ (Ada, Hopper, Blackwell) "
            f"for float8 GEMMs; no CUDA device is available {hint}"
        )
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < _MIN_CAPABILITY:
        raise RuntimeError(
            f"parallel.float8 needs compute capability 8.9+ (Ada, Hopper, Blackwell) for float8 GEMMs; "
            f"{torch.cuda.get_device_name()} is sm_{major}{minor} {hint}"
        )


_GROUP_ALIGN = 16  # rows per token group of the float8 grouped GEMM (torch._scaled_grouped_mm)


def aligned_rows(
    tokens_per_expert: Tensor, num_rows: int, align: int = _GROUP_ALIGN
) -> tuple[Tensor, Tensor, int]:
    """Where each expert-contiguous row goes when every expert's group starts at a multiple of ``align``.

    Returns ``(dest, ends, size)``: ``dest`` ``[num_rows]`` int64, the padded row of each row (rows past
    the groups land after the last padded group); ``ends`` ``[E]`` int32, the padded groups' end
    offsets; ``size``, ``num_rows + (align - 1) * E`` rounded up to a multiple of ``align``, a static
    bound on the padded row count. No host synchronisation.
    """
    counts = tokens_per_expert.long()
    padded = (counts + align - 1) // align * align
    ends = torch.cumsum(padded, 0)
    # Shift of each expert's rows, then of the rows past the groups (expert id E).
    shift = torch.cat([ends - padded - (torch.cumsum(counts, 0) - counts), (ends[-1:] - counts.sum())])
    rows = torch.arange(num_rows, device=counts.device)
    dest = rows + shift[row_experts(tokens_per_expert, num_rows)]
    # A multiple of ``align`` too: the weight gradient's GEMM reads the padded rows as its K dimension.
    size = -(-(num_rows + (align - 1) * counts.numel()) // align) * align
    return dest, ends.to(torch.int32), size


def float8_grouped_mm(x: Tensor, w: Tensor, tokens_per_expert: Tensor, trans_w: bool = True) -> Tensor:
    """``plait.kernels.gmm(x, w, tokens_per_expert, trans_w=True)`` with float8 GEMMs (rowwise scales,
    forward and backward; torchao's ``_to_fp8_rowwise_then_scaled_grouped_mm``).

    The rows are copied into a buffer whose expert groups start at multiples of 16 (zero rows between),
    multiplied, and gathered back; rows past the groups get an unspecified output, as with ``gmm``.
    The product is bf16, cast to ``x.dtype``.

    Raises:
        ValueError: ``trans_w=False`` (the experts' weights are ``[E, N, K]``).
    """
    if not trans_w:
        raise ValueError("float8_grouped_mm: only trans_w=True ([E, N, K] weights) is supported")
    from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm

    dest, ends, size = aligned_rows(tokens_per_expert, x.shape[0])
    padded = torch.index_copy(x.new_zeros(size, x.shape[1]), 0, dest, x)
    y = _to_fp8_rowwise_then_scaled_grouped_mm(
        padded, w.transpose(-2, -1), ends, out_dtype=torch.bfloat16, pad_token_groups_for_grouped_mm=False
    )
    return y.index_select(0, dest).to(x.dtype)


def _experts_blocker(experts: nn.Module) -> str | None:
    if not isinstance(experts, GroupedExperts):
        return f"{type(experts).__name__} is not GroupedExperts"
    dims = {"hidden_size": experts.hidden_size, "intermediate_size": experts.intermediate_size}
    if bad := [f"{k}={v}" for k, v in dims.items() if v % 16]:
        return f"{', '.join(bad)}: not multiples of 16"
    return None


def float8_linears(model: DecoderStage, skip: Sequence[str] = (), experts: bool = False) -> Float8Conversion:
    """Which linears float8 training converts, without converting anything.

    Candidates are the plain ``nn.Linear`` modules inside the decoder layers, routers excluded, and
    with ``experts`` each MoE layer's routed experts. A candidate is skipped when a dimension is not a
    multiple of 16 (float8 GEMMs need it) or its name contains one of ``skip``.

    Args:
        model: A decoder stage (on any device, meta included).
        skip: Module-name substrings to keep in high precision.
        experts: Include the routed experts (``Float8Training.experts``).
    """
    routers = {id(m) for moe in model.moe_layers() for m in moe.router.modules()}
    inside = {id(m) for layer in model.decoder_layers() for m in layer.modules()}
    converted: list[str] = []
    skipped: list[tuple[str, str]] = []
    for name, module in model.named_modules():
        if type(module) is not nn.Linear or id(module) not in inside or id(module) in routers:
            continue
        hits = [s for s in skip if s in name]
        if hits:
            skipped.append((name, f"matches parallel.float8.skip {hits[0]!r}"))
        elif module.in_features % 16 or module.out_features % 16:
            skipped.append(
                (
                    name,
                    f"in_features={module.in_features}, out_features={module.out_features}: not multiples of 16",
                )
            )
        else:
            converted.append(name)
    if experts:
        names = {id(m): n for n, m in model.named_modules()}
        for moe in model.moe_layers():
            name = names[id(moe.experts)]
            hits = [s for s in skip if s in name]
            why = f"matches parallel.float8.skip {hits[0]!r}" if hits else _experts_blocker(moe.experts)
            if why is None:
                converted.append(name)
            else:
                skipped.append((name, why))
    return Float8Conversion(tuple(converted), tuple(skipped))


def apply_float8(
    model: DecoderStage, config: Float8Training, *, fsdp: bool = False, compile: bool = False
) -> Float8Conversion:
    """Convert the stage's eligible linears (:func:`float8_linears`) to torchao ``Float8Linear``, in place.

    Call on the meta-device stage before tensor parallelism, checkpointing, compile and FSDP
    (:func:`~plait.models.common.parallel.parallelize_decoder` does). Skipped linears are logged.

    Args:
        model: The stage.
        config: Float8 settings (nothing happens when ``config.recipe`` is None).
        fsdp: FSDP2 will shard the stage (``tensorwise`` then all-gathers float8 weights unless
            ``config.fsdp_float8_all_gather`` is False).
        compile: The layers will be compiled (``rowwise`` recipes then make inductor round its
            casts as eager does, torchtitan's setting).

    Returns:
        The converted and skipped linears (empty when float8 is off).

    Raises:
        ImportError: torchao is not installed (names the ``plait-models[float8]`` extra).
        RuntimeError: no float8-capable GPU and not ``config.emulate``.
    """
    if config.recipe is None:
        return Float8Conversion((), ())
    check_float8(config)
    float8 = _torchao_float8()
    plan = float8_linears(model, config.skip, config.experts)
    all_gather = config.fsdp_float8_all_gather
    if all_gather is None:
        all_gather = fsdp and config.recipe == "tensorwise"
    ao_config = dataclasses.replace(
        float8.Float8LinearConfig.from_recipe_name(config.recipe),
        enable_fsdp_float8_all_gather=all_gather,
        emulate=config.emulate,
    )
    chosen = set(plan.converted)
    float8.convert_to_float8_training(
        model, config=ao_config, module_filter_fn=lambda _module, fqn: fqn in chosen
    )
    if config.experts:
        _torchao_grouped_mm()
        for name, module in model.named_modules():
            if name in chosen and isinstance(module, GroupedExperts):
                module.grouped_mm = float8_grouped_mm
    if compile and config.recipe.startswith("rowwise"):
        # Without it, inductor keeps bf16 -> fp32 -> bf16 round trips out of the compiled casts and the
        # rowwise scales differ from eager's (torchtitan sets it for the same reason).
        import torch._inductor.config as inductor_config

        inductor_config.emulate_precision_casts = True
    if plan.skipped:
        logger.warning(
            "float8: %d linear(s) kept in high precision: %s",
            len(plan.skipped),
            "; ".join(f"{n} ({why})" for n, why in plan.skipped),
        )
    return plan


def precompute_float8_scales(modules: Iterable[nn.Module]) -> None:
    """Compute the float8 scales of FSDP2-sharded ``tensorwise`` weights for the next all-gather
    (one all-reduce for all of them); call after every optimizer step. A no-op for modules without
    float8 all-gather weights.

    Raises:
        ImportError: torchao is not installed.
    """
    float8 = _torchao_float8()
    for module in modules:
        float8.precompute_float8_dynamic_scale_for_fsdp(module)
