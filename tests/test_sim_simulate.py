"""Tests for tplib.sim.simulate (and the timeline plot of tplib.tables.plots)."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit_costs import ConstantCosts, UnsplitCosts
from tplib.plan import Plan
from tplib.planner import pipeline_latency
from tplib.schedule import Action, Kind, Schedule, ScheduleError, make_schedule
from tplib.sim.simulate import (
    TIMELINE_COLUMNS,
    SliceModelCosts,
    costs_from_slice_model,
    simulate,
    simulate_schedule,
)
from tplib.tables.timeline import plot_timeline


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
    r = simulate_schedule("gpipe", n_stages, Plan.gpipe(n_micro, 16), ConstantCosts(1.0, 2.0))
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
    r = simulate_schedule("terapipe", n_stages, plan, costs_from_slice_model(model))
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
    r = simulate_schedule("terapipe", n_stages, plan, costs_from_slice_model(model, fwd_fraction))
    assert r.latency == pytest.approx(pipeline_latency(plan, model, n_stages), rel=1e-9)


def test_allreduce_and_optimizer_come_last() -> None:
    plan, k = Plan.uniform(2, 16, n_token_slices=2), 3
    base = simulate_schedule("terapipe", k, plan, ConstantCosts(1.0, 2.0)).latency
    r = simulate_schedule(
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
    r = simulate_schedule("terapipe", 3, plan, ConstantCosts(1.0, 2.0, t_send=0.1))
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
    r = simulate_schedule("1f1b", 3, plan, costs)
    t = simulate_schedule("terapipe", 3, plan, costs)
    model = AttentionLikeCost()
    total = sum(
        float(model.slice_time(1, np.array([16]), np.array([16 * u.t]))[0]) for u in plan.units()
    )
    assert total <= r.latency and total <= t.latency


@pytest.mark.parametrize("validate", [True, False])
@pytest.mark.parametrize(
    ("name", "plan"),
    [("pipedream", Plan.uniform(1, 16, n_token_slices=2)), ("2bw", Plan.gpipe(4, 16))],
)
def test_asynchronous_schedules_simulate_by_name(name: str, plan: Plan, validate: bool) -> None:
    costs = ConstantCosts(1.0, 2.0)
    r = simulate_schedule(name, 3, plan, costs, n_iterations=4, validate=validate)
    want = simulate(make_schedule(name, 3, plan, n_iterations=4), costs)
    assert r.schedule == name and r.latency == want.latency
    pd.testing.assert_frame_equal(r.timeline, want.timeline)
    # Four iterations, each ended by an update on every stage: no flush in between.
    assert (r.timeline["kind"] == "OPT").sum() == 4 * 3
    one = simulate_schedule(name, 3, plan, costs, validate=validate)
    assert (one.timeline["kind"] == "OPT").sum() == 3 and one.latency < r.latency


def test_plot_timeline_draws_simulated_and_measured_traces() -> None:
    r = simulate_schedule(
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


# ---- split backwards (terapipe-zb) ------------------------------------------------------
#
# ConstantCosts(t_f, t_b, t_w) under terapipe-zb: each F costs t_f, each B the backward
# less its unit's weight gradients (t_b - t_w), and a sequence's W t_w per token slice.


@pytest.mark.parametrize(
    ("n_stages", "text", "costs", "want_zb", "want_terapipe"),
    [
        # K=1, three units: F 3 x 1, B 3 x (2-1), W b0 over 3 slices 3 x 1 -> 9; unsplit 3 x 3.
        (1, "[(1, [2, 2, 2])]", (1, 2, 1), 9.0, 9.0),
        # K=2, units u0, u1 of one sequence. Stage 0: F u0 [0,1], F u1 [1,2]. Stage 1:
        # F [1,2], [2,3]; B u1 [3,4], B u0 [4,5]; W b0 (2 slices) [5,7]. Stage 0: B u1
        # when stage 1's ends [4,5], B u0 [5,6], W b0 [6,8] -> 8. Unsplit: stage 1's B
        # [3,5], [5,7]; stage 0's [5,7], [7,9] -> 9.
        (2, "[(1, [2, 2])]", (1, 2, 1), 8.0, 9.0),
        # K=2, two sequences of one slice: as above but W b1 [5,6], W b0 [6,7] on stage 1
        # and [6,7], [7,8] on stage 0 -> 8; unsplit 9.
        (2, "[(1, [2])] * 2", (1, 2, 1), 8.0, 9.0),
        # K=3, the docstring's plan: four units; stage k's F of unit i in [k+i, k+i+1].
        # Stage 2: B [6,7] .. [9,10], W b1 [10,12], W b0 [12,14]. Stage 1: B from 7 to 11,
        # W to 15. Stage 0: B from 8 to 12, W b1 [12,14], W b0 [14,16] -> 16.
        # Unsplit: (4 units + 2) x 3 = 18.
        (3, "[(1, [2, 2])] * 2", (1, 2, 1), 16.0, 18.0),
        # K=2, t_b=3, t_w=2: B costs 1, W 2 per slice. Stage 1: F to 3, B [3,4], [4,5],
        # W b0 [5,9]; stage 0: B [4,5], [5,6], W b0 [6,10] -> 10. Unsplit: stage 1 B
        # [3,6], [6,9]; stage 0 [6,9], [9,12] -> 12.
        (2, "[(1, [2, 2])]", (1, 3, 2), 10.0, 12.0),
        # K=2, b0 of three slices, b1 of one. Stage 1: F to 5; B b1t0, b0t2, b0t1, b0t0
        # in [5,9]; W b1 [9,10], W b0 [10,13]. Stage 0: B in [6,10], W b1 [10,11],
        # W b0 [11,14] -> 14. Unsplit: (4 + 1) x 3 = 15.
        (2, "[(1, [1, 1, 2]), (1, [4])]", (1, 2, 1), 14.0, 15.0),
    ],
)
def test_terapipe_zb_latency_by_hand(
    n_stages: int,
    text: str,
    costs: tuple[float, float, float],
    want_zb: float,
    want_terapipe: float,
) -> None:
    plan = Plan.from_paper(text)
    c = ConstantCosts(t_f=costs[0], t_b=costs[1], t_w=costs[2])
    assert simulate_schedule("terapipe-zb", n_stages, plan, c).latency == pytest.approx(want_zb)
    assert simulate_schedule("terapipe", n_stages, plan, c).latency == pytest.approx(want_terapipe)


@pytest.mark.parametrize("text", PLANS)
@pytest.mark.parametrize("n_stages", [1, 3, 8])
def test_terapipe_zb_closed_form_on_constant_costs(text: str, n_stages: int) -> None:
    """With U units: stage K-1 ends its forwards at (U + K - 1) t_f; the split
    backwards then flow to stage 0, which ends them (U + K - 1)(t_b - t_w) later, and
    runs its W (U t_w in all) last."""
    plan = Plan.from_paper(text)
    t_f, t_b, t_w = 1.0, 3.0, 1.25
    r = simulate_schedule("terapipe-zb", n_stages, plan, ConstantCosts(t_f, t_b, t_w=t_w))
    u, k = plan.n_units, n_stages
    assert r.latency == pytest.approx((u + k - 1) * (t_f + t_b - t_w) + u * t_w)


def test_terapipe_zb_timeline_has_w_rows() -> None:
    plan = Plan.from_paper("[(1, [2, 2])] * 2")
    r = simulate_schedule("terapipe-zb", 3, plan, ConstantCosts(1.0, 2.0, t_w=1.0))
    tl = r.timeline
    assert set(tl["kind"]) == {"F", "B", "W", "SA", "RA", "SG", "RG", "AR", "OPT"}
    w = tl[tl.kind == "W"]
    assert len(w) == 3 * plan.n_batch_slices and (w["t"] == -1).all()
    assert np.allclose(w["end"] - w["start"], 2.0)  # t_w per token slice, 2 slices
    b = tl[tl.kind == "B"]
    assert np.allclose(b["end"] - b["start"], 1.0)  # t_b - t_w
    stage0 = w[w.stage == 0].sort_values("start")
    assert list(stage0["b"]) == [1, 0]
    assert list(zip(stage0["start"], stage0["end"], strict=True)) == [(12.0, 14.0), (14.0, 16.0)]
    stage2 = w[w.stage == 2].sort_values("start")
    assert list(zip(stage2["start"], stage2["end"], strict=True)) == [(10.0, 12.0), (12.0, 14.0)]
    # Busy time counts the W: every stage does 4 F + 4 B + 4 W-slices of work.
    assert np.allclose(r.busy, 4 * 1.0 + 4 * 1.0 + 4 * 1.0)


@pytest.mark.parametrize("text", PLANS)
@pytest.mark.parametrize("n_stages", [1, 2, 4, 8])
def test_terapipe_zb_is_no_slower_than_terapipe(text: str, n_stages: int) -> None:
    plan = Plan.from_paper(text)
    for costs in (
        ConstantCosts(1.0, 2.0, t_w=1.0),
        SliceModelCosts(AttentionLikeCost(), wgrad_fraction=0.3),
    ):
        zb = simulate_schedule("terapipe-zb", n_stages, plan, costs).latency
        base = simulate_schedule("terapipe", n_stages, plan, costs).latency
        assert zb <= base * (1 + 1e-12)
        if n_stages > 1:
            assert zb < base  # stage 0 gets its gradients sooner


def test_split_schedules_need_split_backward_costs() -> None:
    plan = Plan.uniform(2, 16, n_token_slices=2)
    # Unsplit it simulates: 4 units, F and B 1 each, on 2 stages: (4 + 1) x 2.
    assert simulate_schedule("terapipe", 2, plan, UnsplitCosts()).latency == pytest.approx(10.0)
    for name in ("terapipe-zb", "1f1b-zb"):
        with pytest.raises(ValueError, match="SplitBackwardCosts") as info:
            simulate_schedule(name, 2, plan, UnsplitCosts())
        assert "UnsplitCosts" in str(info.value)
    # A W dearer than its backward would leave B a negative time.
    with pytest.raises(ValueError, match="finite, non-negative"):
        simulate_schedule("terapipe-zb", 2, plan, ConstantCosts(1.0, 2.0, t_w=2.5))
