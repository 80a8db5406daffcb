"""Action IR, topologies, builders, lowering and the validator (pure Python)."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
from plait.pipelining import (
    Action,
    ActionKind,
    CommGroup,
    OverlapAction,
    Program,
    ProgramError,
    build_1f1b,
    build_dualpipev,
    build_gpipe,
    build_inference,
    build_interleaved_1f1b,
    build_looped_bfs,
    build_program,
    build_zb1p,
    build_zbv,
    dry_run,
    loop_topology,
    lower,
    parse_action,
    parse_program,
    validate,
    vshape_topology,
)
from plait.pipelining.schedules import round_sizes
from torch.distributed.pipelining import schedules as torch_schedules


def test_action_strings_round_trip() -> None:
    for text in [
        "0F3",
        "1I2",
        "1W2",
        "12B0",
        "2SEND_F0",
        "3RECV_F1",
        "0SEND_B7",
        "1RECV_B2",
        "0F3|5B1",
        "1F0|2I3",
    ]:
        a = parse_action(text)
        assert str(a) == text
    assert parse_action("0F3") == Action(0, ActionKind.FORWARD, 3)
    group = parse_action("0SEND_F1+0RECV_B0")
    assert isinstance(group, CommGroup) and str(group) == "0SEND_F1+0RECV_B0" and group.is_comm
    with pytest.raises(ValueError, match="send/receive actions only"):
        parse_action("0SEND_F1+0F2")
    assert parse_action("0F3|5B1") == OverlapAction(
        Action(0, ActionKind.FORWARD, 3), Action(5, ActionKind.BACKWARD, 1)
    )
    with pytest.raises(ValueError, match="Cannot parse action"):
        parse_action("0X3")
    with pytest.raises(ValueError, match="must be a forward"):
        parse_action("0B3|1B2")


def test_topologies() -> None:
    loop = loop_topology(4, 2)
    assert loop.stages_of(1) == (1, 5) and loop.rank_of(6) == 2 and loop.num_stages == 8
    v = vshape_topology(4)
    assert v.stages_of(0) == (0, 7) and v.stages_of(3) == (3, 4)
    assert v.is_local_edge(3) and not v.is_local_edge(2)


def _all_programs(pp: int, m: int) -> list[Program]:
    progs = [build_gpipe(pp, m), build_1f1b(pp, m), build_looped_bfs(pp, m, 2), build_inference(pp, m, 2)]
    if m >= pp:
        progs += [build_interleaved_1f1b(pp, m, 2), build_interleaved_1f1b(pp, m, 3)]
        progs += [build_zb1p(pp, m, 1), build_zb1p(pp, m, 2), build_zbv(pp, m)]
    if m >= 2 * pp:
        progs += [build_dualpipev(pp, m), build_dualpipev(pp, m, "reference")]
    return progs


@pytest.mark.parametrize("pp", [1, 2, 3, 4])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 8, 9, 11])
def test_every_builder_lowers_to_a_valid_deadlock_free_program(pp: int, m: int) -> None:
    for prog in _all_programs(pp, m):
        low = lower(prog)
        validate(low)
        assert parse_program(low.format()) == low  # text dump round-trips


def test_builders_reject_unsupported_sizes() -> None:
    with pytest.raises(
        ValueError, match=r"interleaved_1f1b: num_microbatches \(3\) must be >= the pipeline size \(4\)"
    ):
        build_interleaved_1f1b(4, 3, 2)
    with pytest.raises(ValueError, match=r"zb1p: num_microbatches \(3\) must be >= the pipeline size \(4\)"):
        build_zb1p(4, 3, 2)
    with pytest.raises(ValueError, match="stages_per_rank must be >= 2"):
        build_interleaved_1f1b(2, 4, 1)
    with pytest.raises(ValueError, match=r"must be >= 2 \* pipeline size"):
        build_dualpipev(4, 6)
    with pytest.raises(ValueError, match=r"dualpipev: order must be 'greedy' or 'reference', got 'deepseek'"):
        build_dualpipev(2, 4, "deepseek")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="order"):
        build_program({"kind": "dualpipev", "num_microbatches": 4, "order": "deepseek"}, 2)
    with pytest.raises(ValueError, match="must be >= the pipeline size"):
        build_zbv(4, 3)
    with pytest.raises(ValueError, match="num_microbatches"):
        build_program({"kind": "gpipe", "num_microbatches": 0}, 2)


def _broken(text: str) -> Program:
    return parse_program(text)


HEAD = "# program t microbatches=2 stage_to_rank=0,1 style=loop lowered=1 backward=1"


def test_validator_accepts_hand_written_gpipe() -> None:
    good = (
        HEAD
        + """
rank 0: 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1
rank 1: 1RECV_F0 1F0 1RECV_F1 1F1 1B0 1SEND_B0 1B1 1SEND_B1
"""
    )
    validate(_broken(good))


def test_validator_rejects_missing_receive() -> None:
    bad = (
        HEAD
        + """
rank 0: 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1
rank 1: 1RECV_F0 1F0 1F1 1B0 1SEND_B0 1B1 1SEND_B1
"""
    )
    with pytest.raises(ProgramError, match=r"1F1 runs before 1RECV_F1") as e:
        validate(_broken(bad))
    assert ">>> [  2] 1F1" in str(e.value)  # the rank's program with the bad action marked


def test_validator_rejects_swapped_order() -> None:
    bad = (
        HEAD
        + """
rank 0: 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1
rank 1: 1RECV_F1 1F1 1RECV_F0 1F0 1B0 1SEND_B0 1B1 1SEND_B1
"""
    )
    with pytest.raises(ProgramError, match="order mismatch") as e:
        validate(_broken(bad))
    assert ">>> [  0] 1RECV_F1" in str(e.value)


def test_validator_rejects_duplicated_microbatch() -> None:
    bad = (
        HEAD
        + """
rank 0: 0F0 0SEND_F0 0F0 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1
rank 1: 1RECV_F0 1F0 1RECV_F1 1F1 1B0 1SEND_B0 1B1 1SEND_B1
"""
    )
    with pytest.raises(ProgramError, match="0F0 appears twice"):
        validate(_broken(bad))


def test_validator_rejects_backward_before_forward_and_missing_weight() -> None:
    bad = (
        HEAD
        + """
rank 0: 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1
rank 1: 1RECV_F0 1B0 1F0 1RECV_F1 1F1 1SEND_B0 1B1 1SEND_B1
"""
    )
    with pytest.raises(ProgramError, match="1B0 runs before 1F0"):
        validate(_broken(bad))
    missing_w = (
        HEAD
        + """
rank 0: 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0I0 0RECV_B1 0B1
rank 1: 1RECV_F0 1F0 1RECV_F1 1F1 1B0 1SEND_B0 1B1 1SEND_B1
"""
    )
    with pytest.raises(ProgramError, match="backward W of stage 0 microbatch 0 is missing"):
        validate(_broken(missing_w))


def test_validator_rejects_wrong_rank_and_detects_deadlock() -> None:
    wrong = (
        HEAD
        + """
rank 0: 0F0 1F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1
rank 1: 1RECV_F0 1RECV_F1 1F1 1B0 1SEND_B0 1B1 1SEND_B1
"""
    )
    with pytest.raises(ProgramError, match="belongs to rank 1, not rank 0"):
        validate(_broken(wrong))
    # Both ranks wait for each other's gradient/activation: rank 0 receives B0 before sending F1,
    # rank 1 needs F1 before it sends B0.
    dead = (
        HEAD
        + """
rank 0: 0F0 0SEND_F0 0RECV_B0 0B0 0F1 0SEND_F1 0RECV_B1 0B1
rank 1: 1RECV_F0 1F0 1RECV_F1 1F1 1B0 1SEND_B0 1B1 1SEND_B1
"""
    )
    with pytest.raises(ProgramError, match="deadlock"):
        validate(_broken(dead))


def test_lowering_is_stream_safe_for_looped_bfs() -> None:
    # Naive "send after, receive before" lowering deadlocks here when each rank runs its communication in
    # order on one stream (NCCL): rank 1's activation send to stage 2 would wait behind rank 0's queue.
    prog = lower(build_looped_bfs(2, 4, 2))
    validate(prog)
    assert prog.lowered and all(any(a.is_comm for a in acts) for acts in prog.actions)


def test_validator_rejects_groups_that_do_not_pair_up() -> None:
    # The grouping that hung the main job on NCCL (two tensors per message): rank 0 posts its activation send
    # and its gradient receive in one group, rank 1 receives and later sends in groups of their own. NCCL
    # pairs a group's k-th send with its k-th receive per peer, so rank 0's second tensor waited behind the
    # gradient that rank 1 only computes after receiving it. The plain dry run accepts this program.
    bad = (
        HEAD
        + """
rank 0: 0F0 0SEND_F0 0F1 0SEND_F1+0RECV_B0 0B0 0RECV_B1 0B1
rank 1: 1RECV_F0 1F0 1RECV_F1 1B0 1SEND_B0 1F1 1B1 1SEND_B1
"""
    )
    with pytest.raises(
        ProgramError, match=r"group \[3\] 0SEND_F1\+0RECV_B0 does not pair with one group of rank 1"
    ):
        validate(_broken(bad))
    dry_run(_broken(bad))  # the queue model alone does not see it
    good = bad.replace("0SEND_F1+0RECV_B0", "0SEND_F1 0RECV_B0")
    validate(_broken(good))


def test_lowering_groups_messages_by_instant() -> None:
    # 1F1B on 2 ranks: rank 0's activation send of microbatch 1 and its gradient receive of microbatch 0
    # leave at different instants, so they are separate groups; an exchange of one instant is one group.
    low = lower(build_1f1b(2, 4))
    assert "0SEND_F1 0RECV_B0" in low.format()
    dual = lower(build_dualpipev(2, 8))
    groups = [a for acts in dual.actions for a in acts if isinstance(a, CommGroup)]
    assert any({x.kind.value[:4] for x in g.ops} == {"SEND", "RECV"} for g in groups)  # exchanges exist
    validate(dual)
    # The forward of an F|B pair finishes first: its cross-rank send leaves in the next group, without the
    # backward's send, so the executor can post it while the backward computes.
    checked = 0
    topo = dual.topology
    for acts in dual.actions:
        for a, nxt in itertools.pairwise(acts):
            if not isinstance(a, OverlapAction) or a.forward.stage == topo.num_stages - 1:
                continue
            if topo.is_local_edge(a.forward.stage):
                continue
            ops = {str(x) for x in nxt.sub_actions()}
            f, b = a.forward, a.backward
            assert f"{f.stage}SEND_F{f.microbatch}" in ops and f"{b.stage}SEND_B{b.microbatch}" not in ops
            checked += 1
    assert checked == 6


def _torch_order(cls: type, rank: int, **attrs: int) -> list[str]:
    """torch.distributed.pipelining's compute order for `rank` in plait's spelling (its idle slots dropped)."""
    ops = cls._calculate_single_rank_operations(SimpleNamespace(**attrs), rank)
    return [
        "|".join(str(x) for x in a.sub_actions) if a.sub_actions else str(a) for a in ops if a is not None
    ]


@pytest.mark.parametrize(
    "pp,m,v", [(2, 3, 2), (3, 5, 2), (4, 6, 2), (4, 10, 2), (3, 4, 3), (3, 8, 2), (4, 8, 2), (4, 12, 3)]
)
def test_interleaved_order_is_torchs_for_every_size_torch_takes(pp: int, m: int, v: int) -> None:
    # torch's ScheduleInterleaved1F1B runs max(1, m // pp) rounds of m // rounds microbatches when the
    # rounds divide m (pp=4, m=6: one round of 6; pp=4, m=10: two of 5), as Megatron's microbatch groups do.
    rounds = max(1, m // pp)
    assert m % rounds == 0 and round_sizes(pp, m) == [m // rounds] * rounds
    prog = build_interleaved_1f1b(pp, m, v)
    for r in range(pp):
        theirs = _torch_order(
            torch_schedules.ScheduleInterleaved1F1B,
            r,
            pp_group_size=pp,
            _n_microbatches=m,
            n_local_stages=v,
            microbatches_per_round=m // rounds,
        )
        assert [str(a) for a in prog.actions[r]] == theirs, f"rank {r}"


def test_interleaved_rounds_when_torch_rejects_the_size() -> None:
    # pp=4, m=9: torch wants the 2 rounds to divide 9; plait runs a round of 5, then one of 4 (larger first:
    # the warmup is sized by the first round).
    assert round_sizes(4, 9) == [5, 4] and round_sizes(3, 11) == [4, 4, 3] and round_sizes(4, 3) == [3]
    prog = build_interleaved_1f1b(4, 9, 2)
    fwd = [str(a) for a in prog.actions[3] if a.kind is ActionKind.FORWARD]  # type: ignore[union-attr]
    assert fwd[:10] == ["3F0", "3F1", "3F2", "3F3", "3F4", "7F0", "7F1", "7F2", "7F3", "7F4"]
    validate(lower(prog))


@pytest.mark.parametrize("pp,m", [(1, 2), (1, 5), (2, 4), (2, 5), (2, 9), (3, 6), (3, 10), (4, 8), (4, 13)])
def test_dualpipev_reference_order_is_deepseeks(pp: int, m: int) -> None:
    # torch's ScheduleDualPipeV writes DeepSeek's DualPipeV.step (github.com/deepseek-ai/DualPipe) as
    # actions; plait's reference order must be the same action for action, overlapped pairs included.
    prog = build_dualpipev(pp, m, "reference")
    for r in range(pp):
        theirs = _torch_order(torch_schedules.ScheduleDualPipeV, r, pp_group_size=pp, _n_microbatches=m)
        assert [str(a) for a in prog.actions[r]] == theirs, f"rank {r}"
    assert build_program({"kind": "dualpipev", "num_microbatches": m, "order": "reference"}, pp) == prog
    validate(lower(prog))
