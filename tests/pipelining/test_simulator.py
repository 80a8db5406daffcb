"""Simulator: analytic bubbles, memory, timelines."""

from __future__ import annotations

import re

import pytest
from plait.pipelining import (
    ActionCosts,
    build_1f1b,
    build_dualpipev,
    build_gpipe,
    build_interleaved_1f1b,
    build_zb1p,
    build_zbv,
    lower,
    simulate,
)


@pytest.mark.parametrize("pp,m", [(2, 1), (2, 4), (4, 4), (4, 8), (3, 7)])
def test_gpipe_and_1f1b_bubble_is_analytic(pp: int, m: int) -> None:
    costs = ActionCosts(forward=1.0, backward=2.0)
    for prog in (build_gpipe(pp, m), build_1f1b(pp, m)):
        sim = simulate(lower(prog), costs)
        assert sim.bubble_fraction == pytest.approx((pp - 1) / (m + pp - 1))
        assert sim.step_time == pytest.approx((m + pp - 1) * 3.0)


@pytest.mark.parametrize(
    "pp,m,v",
    [(2, 4, 2), (4, 8, 2), (4, 4, 3), (2, 6, 4), (2, 3, 2), (3, 5, 2), (4, 6, 2), (4, 9, 2), (3, 11, 3)],
)
def test_interleaved_bubble_is_analytic(pp: int, m: int, v: int) -> None:
    # Also when m is not a multiple of pp (rounds of unequal size): the fill and drain stay pp - 1 slots.
    for f, b in ((1.0, 1.0), (1.0, 2.0)):
        sim = simulate(lower(build_interleaved_1f1b(pp, m, v)), ActionCosts(forward=f, backward=b))
        assert sim.bubble_fraction == pytest.approx((pp - 1) / (v * m + pp - 1))


def test_peak_activations_1f1b_vs_gpipe() -> None:
    pp, m = 4, 8
    assert simulate(build_1f1b(pp, m)).peak_activations == (4.0, 3.0, 2.0, 1.0)
    assert simulate(build_gpipe(pp, m)).peak_activations == (8.0,) * 4
    half = ActionCosts(activation_memory=0.5)
    assert simulate(build_1f1b(pp, m), half).peak_activations == (2.0, 1.5, 1.0, 0.5)


@pytest.mark.parametrize("build", [build_zb1p, build_zbv], ids=["zb1p", "zbv"])
def test_input_pass_frees_counts_activations_from_forward_to_input_pass(build) -> None:  # type: ignore[no-untyped-def]
    # Compiled layers: I is the whole backward and frees the activations, W costs nothing. The peak is the
    # most (stage, microbatch) pairs of a rank between the start of F and the end of I, counted from the
    # timeline; without the flag they stay until W, which is never less.
    pp, m = 2, 4
    prog = lower(build(pp, m))
    freed_at_i = simulate(prog, ActionCosts(backward_input=2.0, backward_weight=0.0, input_pass_frees=True))
    for r in range(pp):
        events = []
        for e in freed_at_i.timeline:
            kind = re.fullmatch(r"\d+([FIW])\d+", e.action)
            if e.rank == r and kind and kind.group(1) in "FI":
                events.append((e.start, 1) if kind.group(1) == "F" else (e.end, -1))
        live = peak = 0
        for _, d in sorted(events):
            live += d
            peak = max(peak, live)
        assert freed_at_i.peak_activations[r] == peak
    held_to_w = simulate(prog, ActionCosts(backward_input=2.0, backward_weight=0.0))
    assert all(a <= b for a, b in zip(freed_at_i.peak_activations, held_to_w.peak_activations))


@pytest.mark.parametrize("pp,m", [(4, 8), (2, 3), (3, 5), (4, 6)])
def test_zero_bubble_schedules_beat_1f1b_with_split_backward(pp: int, m: int) -> None:
    costs = ActionCosts(forward=1.0, backward_input=1.0, backward_weight=1.0)
    base = simulate(lower(build_1f1b(pp, m)), costs).bubble_fraction
    progs = [build_zb1p(pp, m, 1), build_zb1p(pp, m, 2), build_zbv(pp, m)]
    if m >= 2 * pp:
        progs += [build_dualpipev(pp, m), build_dualpipev(pp, m, "reference")]
    for prog in progs:
        assert simulate(lower(prog), costs).bubble_fraction < base, prog.name


@pytest.mark.parametrize("pp,m", [(1, 3), (2, 4), (2, 9), (3, 6), (4, 8), (4, 16), (8, 16), (8, 33)])
def test_dualpipev_reference_matches_deepseeks_table(pp: int, m: int) -> None:
    # DeepSeek's README (github.com/deepseek-ai/DualPipe), with PP = 2 * pp stages and F = I = W: each rank
    # idles (PP/2 - 1)(F&B + B - 3W) and holds PP + 1 stage activations. The simulator runs F|B as F + B.
    f = i = w = 1.0
    b = i + w
    sim = simulate(lower(build_dualpipev(pp, m, "reference")), ActionCosts(forward=f, backward_input=i))
    assert sim.busy == (2 * m * (f + b),) * pp
    assert sim.step_time == pytest.approx(2 * m * (f + b) + (pp - 1) * ((f + b) + b - 3 * w))
    assert sim.peak_activations == (2 * pp + 1.0,) * pp
    # plait's greedy order holds more on every rank (its budget admits up to 2 * pp microbatches per rank).
    greedy = simulate(lower(build_dualpipev(pp, m)), ActionCosts(forward=f, backward_input=i))
    assert pp == 1 or all(p > 2 * pp + 1 for p in greedy.peak_activations)


def test_comm_latency_adds_to_critical_path() -> None:
    pp, m = 2, 2
    t0 = simulate(build_gpipe(pp, m), ActionCosts(comm=0.0)).step_time
    t1 = simulate(build_gpipe(pp, m), ActionCosts(comm=0.5)).step_time
    assert t1 == pytest.approx(t0 + 2 * 0.5)  # one forward hop and one backward hop on the critical path


def test_ascii_and_png_html(tmp_path) -> None:  # type: ignore[no-untyped-def]
    sim = simulate(lower(build_1f1b(2, 2)))
    text = sim.render_ascii()
    assert "rank  0" in text and "[0F0" in text and "[1B1" in text
    png = sim.save(tmp_path / "t.png")
    assert png.read_bytes()[:4] == b"\x89PNG"
    html = sim.save(tmp_path / "t.html").read_text()
    assert html.startswith("<!doctype html>") and "<svg" in html


def test_stage_costs_make_the_slow_stage_the_critical_path() -> None:
    # GPipe, 2 stages, 4 microbatches; stage 1 (say, the head) costs twice stage 0 (F 2, B 4 vs F 1, B 2).
    # Stage 1 forwards run 1..9, its backwards 9..25; stage 0's backward of each microbatch (2) follows
    # stage 1's by 2, so the step ends at 27. Busy: 4 * (1 + 2) = 12 and 4 * (2 + 4) = 24.
    slow = ActionCosts(forward=2.0, backward=4.0)
    res = simulate(lower(build_gpipe(2, 4)), ActionCosts(forward=1.0, backward=2.0), stage_costs={1: slow})
    assert res.step_time == 27.0 and res.busy == (12.0, 24.0)
    assert abs(res.bubble_fraction - (1 - 36 / 54)) < 1e-12
    with pytest.raises(ValueError, match=r"stage_costs: stages \[2\] do not exist"):
        simulate(build_gpipe(2, 4), stage_costs={2: slow})
