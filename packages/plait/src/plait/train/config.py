"""The job's config: the loop's sections plus the model (any family), its parallel plan and the data."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from plait.loop import TrainerConfig
from plait.loop.config import nearest_key
from plait.loop.data import ByteTokenizer, DataConfig
from plait.models import DecoderConfig, ParallelConfig, config_class_for, parse_config
from pydantic import Field, SerializeAsAny, ValidationError, field_validator, model_validator

if TYPE_CHECKING:
    from plait.pipelining import Program

__all__ = ["JobConfig", "StartupError", "describe_errors"]


class StartupError(Exception):
    """A flag, file or path that keeps the job from starting; the message says which and why."""


def describe_errors(err: ValidationError, prefix: str = "", fields: Iterable[str] | None = None) -> str:
    """pydantic's errors as one line each: the dotted key (after ``prefix``), the message and the value;
    an unknown key of ``fields`` (a field name collection) names the nearest known one."""
    out = []
    for e in err.errors():
        loc = prefix + ".".join(str(p) for p in e["loc"])
        msg = str(e["msg"]).removeprefix("Value error, ")
        if e["type"] == "extra_forbidden" and fields is not None and len(e["loc"]) == 1:
            msg = f"unknown key{nearest_key(str(e['loc'][0]), fields, prefix)}"
            out.append(f"{loc}: {msg}")
            continue
        out.append(f"{loc}: {msg} (got {e.get('input')!r})" if loc else msg)
    return "; ".join(out)


class JobConfig(TrainerConfig):
    """The job's config: the loop's sections (``run``, ``batching``, ``optimizer``, ...), the model of any
    family (``[model]`` with its Hugging Face ``model_type``; the other keys are that family's
    ``config.json`` fields), the model's dtype and parallel plan, and the data.

    ``model`` is None only until an ``--init-from`` checkpoint's config fills it in.
    """

    # The family of a [model] section without model_type: the main job's (None would make it required).
    DEFAULT_MODEL_TYPE: ClassVar[str | None] = "qwen3_moe"

    model: SerializeAsAny[DecoderConfig] | None = None
    model_dtype: Literal["float32", "bfloat16"] = Field(
        default="float32",
        description="dtype of the model's parameters; bfloat16 pairs with optimizer.name='stochastic_adamw'.",
    )
    parallel: ParallelConfig = ParallelConfig()
    data: DataConfig = DataConfig()

    @field_validator("model", mode="before")
    @classmethod
    def _family_config(cls, value: Any) -> Any:
        """A ``[model]`` table -> the config class of its ``model_type`` (unknown keys are errors)."""
        if not isinstance(value, dict):
            return value
        data = dict(value)
        if "model_type" not in data:
            if cls.DEFAULT_MODEL_TYPE is None:
                raise ValueError("model.model_type is required (e.g. 'llama', 'gpt_oss', 'qwen3_moe')")
            data["model_type"] = cls.DEFAULT_MODEL_TYPE
        try:
            return parse_config(data)
        except ValidationError as e:
            fields = config_class_for(data["model_type"]).model_fields
            raise ValueError(describe_errors(e, "model.", fields)) from None

    @model_validator(mode="after")
    def _check_model_against_run(self) -> JobConfig:
        """Conflicts between the model section and the others, each naming both fields."""
        m = self.model
        if m is None:
            return self
        if self.batching.seq_len > m.max_position_embeddings:
            raise ValueError(
                f"batching.seq_len={self.batching.seq_len} is larger than "
                f"model.max_position_embeddings={m.max_position_embeddings}"
            )
        if self.data.tokenizer == "bytes" and m.vocab_size < ByteTokenizer.vocab_size:
            raise ValueError(
                f"model.vocab_size={m.vocab_size} is smaller than the byte tokenizer's "
                f"{ByteTokenizer.vocab_size} token ids (data.tokenizer='bytes')"
            )
        stages = self.num_pipeline_stages
        if stages > m.num_hidden_layers:
            raise ValueError(
                f"model.num_hidden_layers={m.num_hidden_layers} is fewer than the {stages} pipeline stages of "
                f"mesh.pipeline={self.mesh.pipeline} x the schedule's stages per rank (pipeline.kind)"
            )
        if stages > 1 and m.tie_word_embeddings:
            raise ValueError(
                "model.tie_word_embeddings=true cannot be split over pipeline stages "
                f"(mesh.pipeline={self.mesh.pipeline}); set it to false"
            )
        ac, compiled = self.parallel.activation_checkpointing, self.parallel.compile
        if self.mesh.pipeline > 1 and ac.mode == "selective" and not compiled:  # else nothing to refuse
            from plait.loop import BatchPlan
            from plait.pipelining import build_program

            try:
                program = build_program(
                    BatchPlan.from_config(self).schedule(self.pipeline), self.mesh.pipeline
                )
            except ValueError:  # the batch or the schedule is wrong: the trainer's own checks say how
                return self
            if why := split_backward_refusal(program, ac.mode, compiled):
                raise ValueError(why)
        return self


def split_backward_refusal(program: Program | None, checkpointing: str, compiled: bool) -> str | None:
    """Why the decoder layers checkpointed by ``checkpointing`` cannot run the pipeline ``program``, or None.

    A schedule that splits a backward into an input pass and a weight pass runs each layer's backward graph
    twice; torch's eager selective checkpointing allows one backward per checkpointed region (the second
    finds its saved outputs spent). Compiled layers (``parallel.compile``) and full checkpointing run it.
    """
    if checkpointing != "selective" or compiled or program is None or not program.splits_backward:
        return None
    return (
        f"parallel.activation_checkpointing.mode='selective' with eager layers (parallel.compile=false) cannot "
        f"run the {program.name} schedule: it splits each backward into an input and a weight pass, and "
        "torch's eager selective checkpointing allows one backward per checkpointed layer; set "
        "parallel.compile=true, mode='full', or a schedule without a split backward (pipeline.kind gpipe, "
        "1f1b, interleaved_1f1b, looped_bfs)"
    )
