"""Tests for tplib.simulate (and the timeline plot of tplib.plots)."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tplib.plan import Plan
from tplib.planner import pipeline_latency
from tplib.plots import plot_timeline
from tplib.schedule import Action, Kind, Schedule, ScheduleError, make_schedule
from tplib.simulate import (
    TIMELINE_COLUMNS,
    ConstantCosts,
    costs_from_slice_model,
    simulate,
    simulate_plan,
)


class AttentionLikeCost:
    """Non-uniform slice times: a per-slice overhead, linear in tokens, and attention
    over the context (later slices cost more), like a real layer."""

    max_batch_slice_size = None

    def slice_time(self, batch: int, length: np.ndarray, context: np.ndarray) -> np.ndarray:
        length, context = np.asarray(length, float), np.asarray(context, float)
        return 0.3 + batch * (0.05 * length + 0.002 * length * (context + length / 2))


def test_fill_drain_latency_on_unit_costs() -> None:
    for n_stages, plan in [
        (4, Plan.uniform(3, 64, n_token_slices=4)),
        (1, Plan.gpipe(5, 8)),
        (7, Plan.uniform(2, 32, n_token_slices=8)),
    ]:
        name = "terapipe" if plan.n_token_slices(0) > 1 else "gpipe"
        r = simulate(make_schedule(name, n_stages, plan), ConstantCosts(t_f=1.0, t_b=2.0))
        assert r.latency == pytest.approx((plan.n_units + n_stages - 1) * 3.0)


@pytest.mark.parametrize(("n_micro", "n_stages"), [(1, 4), (8, 4), (16, 24), (2, 96)])
def test_gpipe_bubble_fraction(n_micro: int, n_stages: int) -> None:
    r = simulate_plan("gpipe", n_stages, Plan.gpipe(n_micro, 16), ConstantCosts(1.0, 2.0))
    assert r.bubble_fraction == pytest.approx((n_stages - 1) / (n_micro + n_stages - 1))
    assert np.allclose(r.busy, 3.0 * n_micro)
    assert np.allclose(r.idle, r.latency - r.busy)


PLANS = [
    "[(1, [24, 20, 12, 8])] * 2",
    "[(2, [40, 24]), (1, [16] * 4), (3, [64])]",
    "[(1, [8] * 8)]",
]


@pytest.mark.parametrize("text", PLANS)
@pytest.mark.parametrize("n_stages", [1, 3, 8])
def test_terapipe_equals_the_planners_latency_without_communication(
    text: str, n_stages: int
) -> None:
    """Fill-drain with identical stages is a flow shop: latency = sum t + (K-1) max t
    exactly, when the forward takes a fixed fraction of each slice's time."""
    plan, model = Plan.from_paper(text), AttentionLikeCost()
    r = simulate_plan("terapipe", n_stages, plan, costs_from_slice_model(model))
    assert r.latency == pytest.approx(pipeline_latency(plan, model, n_stages), rel=1e-12)


@settings(max_examples=25)
@given(
    st.lists(st.integers(1, 6), min_size=1, max_size=5),  # token slices (grid units)
    st.integers(1, 3),
    st.integers(1, 6),
    st.floats(0.05, 0.95),
)
def test_planner_relationship_holds_for_random_plans(
    slices: list[int], n_batch: int, n_stages: int, fwd_fraction: float
) -> None:
    plan = Plan((1,) * n_batch, (tuple(s * 8 for s in slices),) * n_batch)
    model = AttentionLikeCost()
    r = simulate_plan("terapipe", n_stages, plan, costs_from_slice_model(model, fwd_fraction))
    assert r.latency == pytest.approx(pipeline_latency(plan, model, n_stages), rel=1e-9)


def test_allreduce_and_optimizer_come_last() -> None:
    plan, k = Plan.uniform(2, 16, n_token_slices=2), 3
    base = simulate_plan("terapipe", k, plan, ConstantCosts(1.0, 2.0)).latency
    r = simulate_plan(
        "terapipe", k, plan, ConstantCosts(1.0, 2.0, t_allreduce=5.0, t_optimizer=2.0)
    )
    assert r.latency == pytest.approx(base + 7.0)
    tl = r.timeline
    for _, rows in tl.groupby("stage"):
        ar, opt = rows[rows.kind == "AR"].iloc[0], rows[rows.kind == "OPT"].iloc[0]
        last = rows[rows.kind.isin(["F", "B", "SA", "RA", "SG", "RG"])]["end"].max()
        assert ar.start == pytest.approx(last) and ar.end == pytest.approx(ar.start + 5.0)
        assert opt.start == pytest.approx(ar.end) and opt.end == pytest.approx(ar.end + 2.0)
        assert (ar.b, ar.t) == (-1, -1)
    # Stage 0 finishes the backward last, so it sets the latency.
    assert tl[(tl.stage == 0) & (tl.kind == "OPT")]["end"].iloc[0] == pytest.approx(r.latency)


def test_deadlocked_schedule_raises() -> None:
    plan = Plan.gpipe(1, 8)
    # Both stages start by waiting for the other: stage 0 for a gradient that stage 1
    # sends only after its forward, which waits for stage 0's activation.
    stage0 = [
        Action(Kind.RG, 0, 0, 0),
        Action(Kind.F, 0, 0, 0),
        Action(Kind.SA, 0, 0, 0),
        Action(Kind.B, 0, 0, 0),
    ]
    stage1 = [
        Action(Kind.RA, 1, 0, 0),
        Action(Kind.F, 1, 0, 0),
        Action(Kind.B, 1, 0, 0),
        Action(Kind.SG, 1, 0, 0),
    ]
    bad = Schedule("bad", 2, plan, (tuple(stage0), tuple(stage1)))
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(bad, ConstantCosts())


def test_blocking_and_async_sends() -> None:
    plan = Plan.gpipe(1, 8)
    sched = make_schedule("gpipe", 2, plan)
    # Blocking: the send keeps the sender busy; the message lands when it ends.
    r = simulate(sched, ConstantCosts(1.0, 2.0, t_send=0.5, blocking_sends=True))
    assert r.latency == pytest.approx(2 * 3.0 + 2 * 0.5)
    sa = r.timeline[(r.timeline.kind == "SA")].iloc[0]
    assert (sa.start, sa.end) == (pytest.approx(1.0), pytest.approx(1.5))
    assert r.busy[0] == pytest.approx(3.5) and r.busy[1] == pytest.approx(3.5)
    # Async: same latency here (nothing to overlap with), but the sender is not busy.
    r2 = simulate(sched, ConstantCosts(1.0, 2.0, t_send=0.5))
    assert r2.latency == pytest.approx(7.0) and r2.busy[0] == pytest.approx(3.0)
    # Async sends overlap the next forward; blocking ones serialise with it.
    sched4 = make_schedule("gpipe", 2, Plan.gpipe(4, 8))
    lat_async = simulate(sched4, ConstantCosts(1.0, 2.0, t_send=1.0)).latency
    lat_block = simulate(sched4, ConstantCosts(1.0, 2.0, t_send=1.0), blocking_sends=True).latency
    assert lat_block > lat_async


def test_receive_time_and_bad_costs() -> None:
    sched = make_schedule("gpipe", 2, Plan.gpipe(1, 8))
    # A receive's own work overlaps its wait: stage 1 waits 1.0 for the activation anyway.
    assert simulate(sched, ConstantCosts(1.0, 2.0, t_recv=0.25)).latency == pytest.approx(6.0)
    # A longer receive delays the forward: F at 2.5, B until 5.5; stage 0's gradient
    # receive (posted at 1.0) ends at max(1.0 + 2.5, 5.5); its B ends at 7.5.
    r = simulate(sched, ConstantCosts(1.0, 2.0, t_recv=2.5))
    assert r.latency == pytest.approx(7.5)
    with pytest.raises(ValueError, match="finite, non-negative"):
        simulate(sched, ConstantCosts(-1.0, 2.0))
    with pytest.raises(ValueError, match="finite, non-negative"):
        simulate(sched, ConstantCosts(1.0, 2.0, t_optimizer=float("nan")))


def test_timeline_columns_and_content() -> None:
    plan = Plan.from_paper("[(2, [8, 8]), (1, [16])]")
    r = simulate_plan("terapipe", 3, plan, ConstantCosts(1.0, 2.0, t_send=0.1))
    tl = r.timeline
    assert tuple(tl.columns) == TIMELINE_COLUMNS
    assert (tl["rank"] == tl["stage"]).all() and (tl["replica"] == 0).all()
    assert set(tl["kind"]) == {"F", "B", "SA", "RA", "SG", "RG", "AR", "OPT"}
    assert (tl["end"] >= tl["start"]).all()
    # One F and one B per unit per stage, each lasting its cost.
    fb = tl[tl.kind.isin(["F", "B"])]
    assert len(fb) == 2 * plan.n_units * 3
    assert np.allclose(fb["end"] - fb["start"], np.where(fb["kind"] == "F", 1.0, 2.0))
    # Compute on a stage never overlaps.
    for _, rows in fb.groupby("stage"):
        rows = rows.sort_values("start")
        assert (rows["start"].to_numpy()[1:] >= rows["end"].to_numpy()[:-1] - 1e-12).all()
    assert "bubble" in repr(r)


def test_1f1b_simulates_with_a_slice_model() -> None:
    plan = Plan.uniform(4, 32, n_token_slices=2)
    costs = costs_from_slice_model(AttentionLikeCost())
    r = simulate_plan("1f1b", 3, plan, costs)
    t = simulate_plan("terapipe", 3, plan, costs)
    model = AttentionLikeCost()
    total = sum(
        float(model.slice_time(1, np.array([16]), np.array([16 * u.t]))[0]) for u in plan.units()
    )
    assert total <= r.latency and total <= t.latency


def test_plot_timeline_draws_simulated_and_measured_traces() -> None:
    r = simulate_plan(
        "terapipe",
        3,
        Plan.uniform(2, 16, n_token_slices=2),
        ConstantCosts(1.0, 2.0, 0.1, t_allreduce=1.0, t_optimizer=0.5),
    )
    ax = plot_timeline(r.timeline, title="simulated")
    assert len(ax.get_yticks()) == 3 and ax.get_title() == "simulated"
    # A "measured" trace: two replicas, ranks differ from stages.
    measured = pd.concat(
        [r.timeline.assign(replica=i, rank=r.timeline.stage + 3 * i) for i in range(2)]
    )
    measured["iteration"] = 3
    ax = plot_timeline(measured, replica=1, iteration=3, time_unit=1e-3, stages=[0, 2])
    assert "ms" in ax.get_xlabel() and len(ax.get_yticks()) == 2
    with pytest.raises(ValueError, match="lacks columns"):
        plot_timeline(r.timeline.drop(columns=["kind"]))
    matplotlib.pyplot.close("all")
