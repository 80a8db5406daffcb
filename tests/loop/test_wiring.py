"""The pieces the Trainer is built from, alone: stage placement, the context's dp-size check, the
checkpoint policy of a run, the collective-timeout switch and the loss mode for a schedule."""

from __future__ import annotations

import pytest
import torch
from plait.loop import BatchPlan, Topology, load_config
from plait.loop.checkpoint import TrainingCheckpoints
from plait.loop.engine import _bound_loss_gradients, forwards_in_flight, place_stages
from plait.loop.events import EventBus, StepEnd
from plait.loop.ops import set_collective_timeout
from plait.loop.topology import connect
from plait.pipelining import Program, StageTopology, build_program, parse_action


def _config(tmp_path, *extra: str):
    return load_config(
        overrides=[
            f"--run.run_dir={tmp_path}",
            "--batching.global_batch_size=8",
            "--batching.microbatch_size=2",
            *extra,
        ]
    )


@pytest.mark.parametrize(
    ("schedule", "expected"),
    [
        # stage s of a loop placement runs on rank s % pp; the V shape folds back: 0 1 | 1 0
        (["--pipeline.kind=1f1b"], {0: (2, [0]), 1: (2, [1])}),
        (
            ["--pipeline.kind=interleaved_1f1b", "--pipeline.stages_per_rank=2"],
            {0: (4, [0, 2]), 1: (4, [1, 3])},
        ),
        (["--pipeline.kind=zbv"], {0: (4, [0, 3]), 1: (4, [1, 2])}),
    ],
)
def test_place_stages_follows_the_schedules_placement(tmp_path, schedule, expected):
    cfg = _config(tmp_path, "--mesh.pipeline=2", *schedule)
    plan = BatchPlan.from_config(cfg)
    for pp_rank, placement in expected.items():
        assert place_stages(plan.schedule(cfg.pipeline), Topology(pp_rank=pp_rank, pp_size=2)) == placement


def test_place_stages_without_a_schedule_is_one_stage():
    assert place_stages(None, Topology()) == (1, [0])


class _SingleProcessContext:
    world_size = 1


def test_connect_refuses_a_context_whose_dp_size_is_not_the_configs(tmp_path, monkeypatch):
    # a single process: other tests of the session may have left a default process group behind
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    cfg = _config(tmp_path, "--mesh.data_shard=2")
    with pytest.raises(ValueError, match="data_replicate x data_shard = 2"):
        connect(_SingleProcessContext(), cfg.mesh, torch.device("cpu"), 60.0)  # type: ignore[arg-type]
    ctx = _SingleProcessContext()
    mesh = _config(tmp_path).mesh
    assert connect(ctx, mesh, torch.device("cpu"), 60.0) == (ctx, Topology())  # type: ignore[arg-type]


def test_training_checkpoints_policy(tmp_path):
    cfg = _config(
        tmp_path, "--checkpoint.enabled=true", "--checkpoint.interval=3", "--checkpoint.async_mode=off"
    )
    state = {"x": torch.arange(4.0)}
    ck = TrainingCheckpoints(cfg, lambda: state, EventBus())
    assert ck.checkpointer.root == tmp_path / "checkpoints"
    assert [s for s in range(1, 10) if ck.due(s, last=False)] == [3, 6, 9]
    assert ck.due(7, last=True)
    assert ck.resume() is None  # nothing saved yet
    ck.save(3, blocking=True)
    state["x"] = torch.zeros(4)
    path, meta = ck.resume()  # type: ignore[misc]
    assert meta["step"] == 3 and meta["run"] == cfg.run.name and path.parent == tmp_path / "checkpoints"
    assert torch.equal(state["x"], torch.arange(4.0))
    ck.close()
    no_signals = TrainingCheckpoints(
        _config(tmp_path, "--checkpoint.save_on_signal=false", "--checkpoint.async_mode=off"),
        lambda: state,
        EventBus(),
    )
    assert no_signals.preemption_handler() is None
    handler = ck.preemption_handler()
    assert handler is not None and handler.grace_period_s == cfg.checkpoint.grace_period_s
    handler.restore()


def test_training_checkpoints_poll_after_every_step(tmp_path):
    cfg = _config(tmp_path, "--checkpoint.enabled=true", "--checkpoint.async_mode=off")
    events, calls = EventBus(), []
    ck = TrainingCheckpoints(cfg, lambda: {"x": torch.ones(2)}, events)
    ck.checkpointer.step_done = lambda state: calls.append(state())  # type: ignore[method-assign]
    events.publish(StepEnd(1, {}, lr=0.1, loss_tokens=8, tokens_seen=16, skipped=False, seconds=0.5))
    assert len(calls) == 1 and torch.equal(calls[0]["x"], torch.ones(2))


def test_set_collective_timeout_goes_through_a_context_that_can():
    class Ctx:
        def __init__(self) -> None:
            self.seconds: list[float] = []

        def set_timeout(self, seconds: float) -> None:
            self.seconds.append(seconds)

    ctx = Ctx()
    set_collective_timeout(12.0, (), ctx)
    assert ctx.seconds == [12.0]


def test_forwards_in_flight_and_the_loss_mode():
    """GPipe holds every microbatch's forward before the backwards; 1F1B's last stage alternates; a
    split backward keeps a forward open until its weight pass. Only a default (None) head is switched."""
    gpipe = build_program({"kind": "gpipe", "num_microbatches": 4}, 2)
    one_f_one_b = build_program({"kind": "1f1b", "num_microbatches": 4}, 2)
    assert forwards_in_flight(gpipe, 1) == 4 and forwards_in_flight(one_f_one_b, 1) == 1
    deferred = Program.from_lists(
        StageTopology(1, (0,), "loop"),
        2,
        [[parse_action(a) for a in ["0F0", "0F1", "0I0", "0I1", "0W0", "0W1"]]],
    )
    assert forwards_in_flight(deferred, 0) == 2

    class Head(torch.nn.Module):
        def __init__(self, grad_in_forward: bool | None) -> None:
            super().__init__()
            self.grad_in_forward = grad_in_forward

        def use_two_pass_loss(self) -> bool:
            if self.grad_in_forward is not None:
                return False
            self.grad_in_forward = False
            return True

    for program, default_after in ((gpipe, False), (one_f_one_b, None)):
        stage = torch.nn.Sequential(Head(None), Head(True))
        _bound_loss_gradients({1: stage}, program, 1)
        assert (stage[0].grad_in_forward, stage[1].grad_in_forward) == (default_after, True)


def test_resumed_tracker_run_ids_reach_the_reporter(tmp_path):
    from plait.loop import TrainerState
    from plait.loop.tracking import RunReporter

    state = TrainerState()
    reporter = RunReporter(
        _config(tmp_path), tmp_path, is_main=True, trackers=None, run_ids=state.tracker_run_ids
    )
    saved = {"step": 3, "tracker_run_ids": {"wandb": "run-abc"}}
    state.load_state_dict(saved)  # what a resume does
    assert reporter.run_ids == {"wandb": "run-abc"} and state.step == 3
    state.load_state_dict(state.state_dict())  # its own values: unchanged
    assert reporter.run_ids == {"wandb": "run-abc"}
