"""Pipeline state views, configs and the schedule registry."""

from __future__ import annotations

import pydantic
import pytest
import torch
from plait.pipelining import (
    BaseScheduleConfig,
    Chunk,
    GPipeConfig,
    LoopedScheduleConfig,
    PipelineState,
    Program,
    Shared,
    Stack,
    ZBVConfig,
    build_gpipe,
    build_program,
    parse_schedule_config,
    register_schedule,
    registered_schedules,
)


def test_state_views_round_trip() -> None:
    st = PipelineState(3, specs={"x": Chunk(0), "y": Chunk(1), "loss": Stack(), "n": Shared()})
    x, y = torch.arange(6).view(6, 1), torch.arange(12).view(2, 6)
    st.global_view["x"] = x
    st.global_view["y"] = y
    st.global_view["n"] = torch.tensor(42)
    assert torch.equal(st.microbatch(1)["x"], x[2:4])
    assert torch.equal(st.microbatch(2)["y"], y[:, 4:6])
    assert st.microbatch(0)["n"].item() == 42
    assert torch.equal(st.global_view["x"], x) and torch.equal(st.global_view["y"], y)
    for i in range(3):
        st.microbatch(i)["loss"] = torch.tensor(float(i))
        st.microbatch(i)["z"] = torch.full((2,), i)  # default spec Chunk(0)
    assert torch.equal(st.global_view["loss"], torch.tensor([0.0, 1.0, 2.0]))
    assert torch.equal(st.global_view["z"], torch.tensor([0, 0, 1, 1, 2, 2]))
    st.global_view["loss"] = torch.tensor([5.0, 6.0, 7.0])  # Stack write unbinds
    assert st.microbatch(2)["loss"].item() == 7.0
    assert set(st.microbatch(0)) == {"x", "y", "n", "loss", "z"}
    st.reset()
    assert len(st.global_view) == 0


def test_state_errors_name_the_key() -> None:
    st = PipelineState(2, specs={"loss": Stack(), "n": Shared()})
    st.microbatch(0)["loss"] = torch.tensor(1.0)
    with pytest.raises(KeyError, match=r"'loss' was not written for microbatches \[1\]"):
        st.global_view["loss"]
    with pytest.raises(KeyError, match="'n' is Shared"):
        st.microbatch(0)["n"] = 1
    with pytest.raises(ValueError, match="'x': cannot split"):
        st.global_view["x"] = torch.zeros(1)


def test_configs_parse_and_validate() -> None:
    cfg = parse_schedule_config({"kind": "interleaved_1f1b", "num_microbatches": 4, "stages_per_rank": 2})
    assert cfg.topology(2).stages_of(1) == (1, 3)
    assert isinstance(parse_schedule_config({"kind": "zbv", "num_microbatches": 4}), ZBVConfig)
    assert ZBVConfig(num_microbatches=4).topology(2).stages_of(0) == (0, 3)
    with pytest.raises(pydantic.ValidationError):
        parse_schedule_config({"kind": "interleaved_1f1b", "num_microbatches": 4, "stages_per_rank": 1})
    with pytest.raises(pydantic.ValidationError):
        GPipeConfig(num_microbatches=2, stages_per_rank=2)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="unknown pipeline schedule kind 'nope'"):
        parse_schedule_config({"kind": "nope", "num_microbatches": 1})
    with pytest.raises(pydantic.ValidationError):
        GPipeConfig(num_microbatches=2).model_copy(update={}).__class__.model_validate(
            {"num_microbatches": 0}
        )


def test_stages_per_rank_is_declared_by_the_looped_base() -> None:
    class WideGPipeConfig(LoopedScheduleConfig):
        kind: str = "test_wide"

    # stage s on rank s % pp, stages_per_rank times around the ranks
    assert WideGPipeConfig(num_microbatches=2, stages_per_rank=3).topology(2).stage_to_rank == (0, 1) * 3
    assert ReverseGPipeConfig(num_microbatches=2).topology(3).stage_to_rank == (0, 1, 2)
    with pytest.raises(
        TypeError, match=r"OddConfig declares stages_per_rank .* subclass LoopedScheduleConfig"
    ):

        class OddConfig(BaseScheduleConfig):
            kind: str = "test_odd"
            stages_per_rank: int = 2


class ReverseGPipeConfig(BaseScheduleConfig):
    kind: str = "test_reverse_gpipe"


def _reverse_gpipe(cfg: ReverseGPipeConfig, pp: int) -> Program:
    prog = build_gpipe(pp, cfg.num_microbatches)
    acts = [list(a[: len(a) // 2]) + list(reversed(a[len(a) // 2 :])) for a in prog.actions]
    return Program.from_lists(prog.topology, prog.num_microbatches, acts, name="reverse_gpipe")


def test_user_schedule_registry() -> None:
    if "test_reverse_gpipe" not in registered_schedules():
        register_schedule("test_reverse_gpipe", ReverseGPipeConfig, _reverse_gpipe)
    prog = build_program({"kind": "test_reverse_gpipe", "num_microbatches": 3}, 2)
    assert [str(a) for a in prog.actions[0]][-1] == "0B0"
    with pytest.raises(ValueError, match="already registered"):
        register_schedule("gpipe", GPipeConfig, lambda c, pp: build_gpipe(pp, 1))


def test_the_registry_is_the_one_list_of_kinds() -> None:
    from pathlib import Path

    from plait.pipelining import PipelineScheduleConfig, RegisteredSchedule, schedule_config_class
    from pydantic import BaseModel

    builtin = {
        k for k in registered_schedules() if schedule_config_class(k).__module__ == "plait.pipelining.config"
    }
    assert {"1f1b", "zbv", "dualpipev", "inference"} <= builtin
    for kind in builtin:
        assert schedule_config_class(kind).model_fields["kind"].default == kind
    assert schedule_config_class("zbv") is ZBVConfig
    with pytest.raises(ValueError, match=r"unknown pipeline schedule kind 'nope'; registered: \["):
        schedule_config_class("nope")
    # the field type validates any registered kind (a user's too) with its class, and round-trips
    if "test_reverse_gpipe" not in registered_schedules():
        register_schedule("test_reverse_gpipe", ReverseGPipeConfig, _reverse_gpipe)

    class Job(BaseModel):
        schedule: PipelineScheduleConfig

    for data in (
        {"kind": "zbv", "num_microbatches": 4},
        {"kind": "test_reverse_gpipe", "num_microbatches": 2},
    ):
        job = Job.model_validate({"schedule": data})
        assert type(job.schedule) is schedule_config_class(data["kind"])
        assert Job.model_validate(job.model_dump()) == job
    with pytest.raises(pydantic.ValidationError, match="unknown pipeline schedule kind 'nope'"):
        Job.model_validate({"schedule": {"kind": "nope", "num_microbatches": 1}})
    with pytest.raises(ValueError, match="defaults to 'zbv'"):
        register_schedule("test_other_zbv", ZBVConfig, lambda c, pp: build_gpipe(pp, 1))
    assert isinstance(RegisteredSchedule("k", ZBVConfig, _reverse_gpipe), RegisteredSchedule)
    # the README's table of microbatch counts covers every built-in kind
    readme = (Path(__file__).parents[2] / "packages/pipelining/README.md").read_text()
    table = readme[readme.index("| schedule | `m` |") :].split("\n\n")[0]
    assert {k for k in builtin if f"`{k}`" in table} == builtin
