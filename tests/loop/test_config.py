"""TrainerConfig: files, overrides, validation errors naming the field, schema."""

from __future__ import annotations

import json

import pytest
from plait.loop import (
    BatchPlan,
    ConfigError,
    TrainerConfig,
    config_json_schema,
    dump_config,
    load_config,
    split_cli_overrides,
)
from plait.loop.config import SGDConfig, read_config_file

TOML = """
[run]
name = "t"
steps = 50

[mesh]
data_shard = 2

[batching]
global_batch_size = 16
microbatch_size = 2

[optimizer]
name = "sgd"
lr = 0.5
momentum = 0.9

[[lr_schedule.segments]]
kind = "linear"
duration = 10
start = 0.0

[[lr_schedule.segments]]
kind = "cosine"
end = 0.0
"""


def test_toml_yaml_json_agree(tmp_path):
    (tmp_path / "c.toml").write_text(TOML)
    from_toml = load_config(tmp_path / "c.toml")
    assert isinstance(from_toml.optimizer, SGDConfig)
    assert from_toml.optimizer.momentum == 0.9
    assert BatchPlan.from_config(from_toml).num_microbatches == 4  # 16 / (2 * dp 2)
    assert from_toml.lr_schedule.segments[1].kind == "cosine"
    dump_config(from_toml, tmp_path / "c.json")
    dump_config(from_toml, tmp_path / "c.yaml")
    assert load_config(tmp_path / "c.json") == from_toml
    assert load_config(tmp_path / "c.yaml") == from_toml


def test_overrides_are_type_coerced():
    cfg = load_config(
        overrides=["--optimizer.lr=3e-4", "--run.steps=7", "--logging.progress_bar=false", "run.name=x"]
    )
    assert cfg.optimizer.lr == pytest.approx(3e-4)
    assert cfg.run.steps == 7 and cfg.run.name == "x"
    assert cfg.logging.progress_bar is False
    cfg = load_config(overrides=["--optimizer.betas=[0.8, 0.9]", "--logging.trackers.0.kind=console"])
    assert cfg.optimizer.betas == (0.8, 0.9)
    assert cfg.logging.trackers[0].kind == "console"


def test_overrides_beat_the_file(tmp_path):
    (tmp_path / "c.toml").write_text(TOML)
    cfg = load_config(tmp_path / "c.toml", ["--optimizer.lr=0.25"])
    assert cfg.optimizer.lr == 0.25 and cfg.optimizer.momentum == 0.9


@pytest.mark.parametrize(
    ("override", "field", "value"),
    [
        ("--optimizer.lr=-1", "optimizer.lr", "-1"),
        ("--optimizer.lrr=1", "optimizer.lrr", "1"),
        ("--run.steps=many", "run.steps", "'many'"),
        ("--grad_clip.max_norm=0", "grad_clip.max_norm", "0"),
        ("--determinism.nonfinite_loss=ignore", "determinism.nonfinite_loss", "'ignore'"),
        ("--optimizer.lr=Infinity", "optimizer.lr", "inf"),
        ("--optimizer.lr=NaN", "optimizer.lr", "nan"),
        ("--optimizer.weight_decay=inf", "optimizer.weight_decay", "'inf'"),
        ("--optimizer.eps=nan", "optimizer.eps", "'nan'"),
        ("--optimizer.betas=[0.9, 1.5]", "optimizer.betas.1", "1.5"),
        ("--grad_clip.max_norm=inf", "grad_clip.max_norm", "'inf'"),
        ("--grad_clip.norm_type=nan", "grad_clip.norm_type", "'nan'"),
        ("--timeouts.step_s=inf", "timeouts.step_s", "'inf'"),
        ("--lr_schedule.segments.0.end=nan", "lr_schedule.segments.0.end", "'nan'"),
    ],
)
def test_bad_values_name_field_and_value(override, field, value):
    with pytest.raises(ConfigError) as e:
        load_config(overrides=[override])
    msg = str(e.value)
    assert f"{field}:" in msg and f"(got {value})" in msg


def test_nesterov_without_momentum_is_refused_naming_both_fields():
    with pytest.raises(ConfigError, match=r"optimizer\.nesterov=true needs optimizer\.momentum > 0"):
        load_config(overrides=["--optimizer.name=sgd", "--optimizer.nesterov=true"])
    assert load_config(
        overrides=["--optimizer.name=sgd", "--optimizer.nesterov=true", "--optimizer.momentum=0.9"]
    )


@pytest.mark.parametrize("name", ["adamw", "stochastic_adamw", "sgd"])
def test_each_optimizer_is_listed_and_its_errors_name_the_plain_field(name):
    from plait.loop.config.sections import OPTIMIZER_NAMES

    assert name in OPTIMIZER_NAMES
    assert load_config(overrides=[f"--optimizer.name={name}"]).optimizer.name == name
    with pytest.raises(ConfigError) as e:
        load_config(overrides=[f"--optimizer.name={name}", "--optimizer.lr=-1"])
    assert "  optimizer.lr:" in str(e.value) and name + "." not in str(e.value)


def test_batch_plan_from_its_sections_alone():
    from plait.dist_core import DeviceMeshParameters
    from plait.loop.config import BatchingConfig, PipelineConfig

    batching = BatchingConfig(global_batch_size=24, microbatch_size=2, seq_len=64)
    mesh = DeviceMeshParameters(data_replicate=2, data_shard=3, context_shard=2, pipeline=2)
    plan = BatchPlan.from_sections(batching, mesh)
    assert (plan.dp_size, plan.cp_size, plan.rank_batch_size, plan.num_microbatches) == (6, 2, 4, 2)
    schedule = plan.schedule(PipelineConfig(kind="gpipe"))
    assert (schedule.kind, schedule.num_microbatches, schedule.loss_reduction) == ("gpipe", 2, "sum")
    assert plan.schedule(None).kind == "1f1b"


def test_batch_plan_from_plain_arguments_and_no_import_circle():
    import ast
    from dataclasses import dataclass
    from pathlib import Path

    import plait.loop.batch_plan as batch_plan
    from plait.dist_core import DeviceMeshParameters

    @dataclass(frozen=True)
    class Sizes:  # any object with the three sizes, not the config's section
        global_batch_size: int = 8
        microbatch_size: int = 2
        seq_len: int = 16

    plan = BatchPlan.from_sections(Sizes(), DeviceMeshParameters(data_shard=2))
    assert (plan.rank_batch_size, plan.num_microbatches) == (4, 2)
    schedule = plan.schedule({"kind": "interleaved_1f1b", "stages_per_rank": 2, "num_microbatches": None})
    assert (schedule.kind, schedule.num_microbatches) == ("interleaved_1f1b", 2)
    with pytest.raises(ValueError, match=r"pipeline\.num_microbatches=3"):
        plan.schedule({"num_microbatches": 3})
    # the batch plan imports nothing of the config (the config imports the plan), not even for typing
    tree = ast.parse(Path(batch_plan.__file__).read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not {m for m in imported if m and m.startswith(("plait.loop.config", "plait.loop.trainer"))}


def test_an_infinite_norm_type_is_the_max_norm():
    assert load_config(overrides=["--grad_clip.norm_type=inf"]).grad_clip.norm_type == float("inf")


def test_bad_file_value_names_field(tmp_path):
    (tmp_path / "c.toml").write_text(TOML.replace("momentum = 0.9", "momentum = -2"))
    with pytest.raises(ConfigError, match=r"optimizer\.momentum: .*got -2"):
        load_config(tmp_path / "c.toml")


def test_grad_accum_validated_against_dp():
    with pytest.raises(
        ConfigError,
        match=r"batching.global_batch_size=10 is not a multiple of batching.microbatch_size \(2\) x data-parallel size \(2\)",
    ):
        load_config(
            overrides=[
                "--batching.global_batch_size=10",
                "--mesh.data_shard=2",
                "--batching.microbatch_size=2",
            ]
        )


def test_seq_len_validated_against_context_parallel_size():
    with pytest.raises(
        ConfigError,
        match=r"batching.seq_len=36 must be a multiple of 2 x context-parallel size \(8\)",
    ):
        load_config(overrides=["--batching.seq_len=36", "--mesh.context_shard=4"])
    cfg = load_config(
        overrides=["--batching.seq_len=40", "--mesh.context_shard=2", "--mesh.context_replicate=2"]
    )
    assert BatchPlan.from_config(cfg).cp_size == 4


def test_bad_override_syntax_and_format(tmp_path):
    with pytest.raises(ConfigError, match=r"expected --section\.field=value"):
        load_config(overrides=["--optimizer.lr"])
    (tmp_path / "c.ini").write_text("x")
    with pytest.raises(ConfigError, match="unknown config format"):
        read_config_file(tmp_path / "c.ini")
    (tmp_path / "bad.toml").write_text("[run\n")
    with pytest.raises(ConfigError, match="cannot parse"):
        read_config_file(tmp_path / "bad.toml")


def test_config_is_frozen_and_schema_exports(tmp_path):
    cfg = TrainerConfig()
    with pytest.raises(Exception, match="frozen"):
        cfg.run.steps = 3  # type: ignore[misc]
    schema = config_json_schema(path=tmp_path / "schema.json")
    assert json.loads((tmp_path / "schema.json").read_text()) == schema
    for section in (
        "run",
        "mesh",
        "batching",
        "pipeline",
        "optimizer",
        "lr_schedule",
        "grad_clip",
        "checkpoint",
    ):
        assert section in schema["properties"]


def test_pipeline_section_uses_the_schedule_union():
    from plait.pipelining import ZBVConfig

    cfg = load_config(
        overrides=[
            "--mesh.pipeline=2",
            "--pipeline.kind=zbv",
            "--batching.global_batch_size=8",
            "--batching.microbatch_size=2",
        ]
    )
    schedule = BatchPlan.from_config(cfg).schedule(cfg.pipeline)
    assert isinstance(schedule, ZBVConfig) and schedule.num_microbatches == 4
    with pytest.raises(ConfigError, match=r"pipeline.num_microbatches=3 must equal .* steps 4"):
        load_config(
            overrides=[
                "--pipeline.kind=1f1b",
                "--pipeline.num_microbatches=3",
                "--batching.global_batch_size=4",
            ]
        )
    with pytest.raises(ConfigError, match=r"pipeline"):
        load_config(overrides=["--pipeline.kind=nope"])


def test_overrides_are_read_by_the_field_type():
    """A string field keeps the text (a numeric run name), other fields decode JSON; none/null is None only
    where the field takes None."""
    cfg = load_config(
        overrides=[
            "--run.name=2024",
            "--checkpoint.dir=007",
            "--logging.peak_flops=null",
            "--gc.generation=2",
            "--optimizer.betas=[0.8, 0.9]",
        ]
    )
    assert cfg.run.name == "2024" and cfg.checkpoint.dir == "007"
    assert cfg.logging.peak_flops is None and cfg.gc.generation == 2
    assert cfg.optimizer.betas == (0.8, 0.9)  # JSON for a tuple field
    assert load_config(overrides=["--run.name=null"]).run.name == "null"  # run.name does not take None
    assert load_config(overrides=["--checkpoint.dir=none"]).checkpoint.dir is None


def test_missing_config_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match=rf"config file {tmp_path / 'nope.toml'} does not exist"):
        load_config(tmp_path / "nope.toml")


def test_num_pipeline_stages_follows_mesh_and_schedule():
    assert load_config().num_pipeline_stages == 1
    assert (
        load_config(overrides=["--mesh.pipeline=2", "--batching.microbatch_size=2"]).num_pipeline_stages == 2
    )
    zbv = load_config(overrides=["--mesh.pipeline=2", "--pipeline.kind=zbv", "--batching.microbatch_size=2"])
    assert zbv.num_pipeline_stages == 4


def test_command_line_overrides_are_dotted_keys_or_the_config_classs_top_level_keys():
    class Job(TrainerConfig):
        dtype: str = "float32"

    argv = ["--run.steps=3", "--dtype=bfloat16", "--steps=4", "--dtype", "x", "--run-dir=d", "file.toml"]
    overrides, rest = split_cli_overrides(argv, Job)
    assert overrides == ["--run.steps=3", "--dtype=bfloat16"]
    assert rest == ["--steps=4", "--dtype", "x", "--run-dir=d", "file.toml"]  # flags stay for argparse
    assert split_cli_overrides(argv)[0] == ["--run.steps=3"]  # without the class: dotted keys only
    assert load_config(None, overrides, cls=Job).dtype == "bfloat16"
