"""Steady-state throughput: hand-derived periods of asynchronous pipelines, the flushed
latency of synchronous ones, and reading T_i and the bubble off a timeline."""

from __future__ import annotations

import pandas as pd
import pytest

from tests.unit_costs import ConstantCosts
from tplib.paper import setting
from tplib.plan import Plan
from tplib.search.setting import cost_model, plan_terapipe
from tplib.sim.simulate import simulate_schedule
from tplib.sim.throughput import steady_bubble, steady_state, steady_window, update_ends

UNIT = ConstantCosts(t_f=1.0, t_b=2.0)  # free communication, free update
SLOW_LINK = ConstantCosts(t_f=1.0, t_b=2.0, t_send=1.0)  # every message spends 1 on the link


def test_pipedream_period_by_hand() -> None:
    """PipeDream on K = 2 stages, one sequence per minibatch, forward 1, backward 2.

    Free links: in steady state both stages alternate one forward and one backward, so
    an iteration takes t_f + t_b = 3 and nothing idles.

    A link of 1 per message: stage 0 keeps at most two minibatches in flight (its one
    warm-up forward, then one forward per backward). A minibatch's round trip from the
    start of its forward on stage 0 to the end of its backward there is
    1 (F0) + 1 (link) + 1 (F1) + 2 (B1) + 1 (link) + 2 (B0) = 8, and two minibatches share
    it: 8 / 2 = 4 per iteration. Each stage works 3 of every 4: bubble 1/4. Iterations
    alternate 3 and 5 (two in flight), so their spread is (5 - 3) / 4 = 0.5."""
    one = Plan.gpipe(1, 16)
    free = steady_state("pipedream", 2, one, UNIT, validate=True)
    assert free.iteration_time == pytest.approx(3.0)
    assert free.bubble_fraction == pytest.approx(0.0, abs=1e-12)
    slow = steady_state("pipedream", 2, one, SLOW_LINK, validate=True)
    assert slow.iteration_time == pytest.approx(4.0)
    assert slow.bubble_fraction == pytest.approx(0.25)
    assert slow.spread == pytest.approx(0.5)
    # Not the flushed latency over N iterations: the fill and the drain cost extra.
    assert slow.sim.latency / slow.n_iterations > 4.0


def test_two_bw_period_by_hand() -> None:
    """2BW on K = 2 with m = 2 microbatches per iteration, same costs and slow link:
    with zero-cost updates its 1F1B order is PipeDream's, microbatch by microbatch, so
    a microbatch takes 4 and an iteration of two 8; bubble 1/4 as before."""
    two = Plan.gpipe(2, 16)
    s = steady_state("2bw", 2, two, SLOW_LINK, validate=True)
    assert s.iteration_time == pytest.approx(8.0)
    assert s.bubble_fraction == pytest.approx(0.25)
    assert s.spread == pytest.approx(0.0, abs=1e-12)


def test_synchronous_steady_state_is_the_flushed_latency() -> None:
    """1F1B on K = 2, two microbatches, free links: stage 0 F0 [0,1] F1 [1,2]; stage 1 F0
    [1,2] B0 [2,4]; stage 0 B0 [4,6]; stage 1 F1 [4,5] B1 [5,7]; stage 0 B1 [7,9]: 9 per
    iteration, each stage busy 6 of 9."""
    two = Plan.gpipe(2, 16)
    s = steady_state("1f1b", 2, two, UNIT, validate=True)
    assert s.iteration_time == pytest.approx(9.0)
    assert s.bubble_fraction == pytest.approx(1 / 3)
    assert s.iteration_time == simulate_schedule("1f1b", 2, two, UNIT).latency
    # Without the flush, the same plan and costs run an iteration in 6 (test above: 3 per
    # microbatch on free links).
    assert steady_state("2bw", 2, two, UNIT).iteration_time == pytest.approx(6.0)


def test_asynchronous_is_never_slower_than_1f1b_on_the_cluster() -> None:
    s = setting(4)  # GPT3-13B, K = 20, 16 sequences per pipeline in 8 batch slices
    cost = cost_model(s)
    p = plan_terapipe(s)
    flushed = steady_state("1f1b", s.n_stages, p, cost)
    two_bw = steady_state("2bw", s.n_stages, p, cost)
    assert two_bw.iteration_time < flushed.iteration_time
    assert two_bw.bubble_fraction < flushed.bubble_fraction
    assert two_bw.spread < 1e-6  # the window is periodic iteration by iteration


def test_window_covers_fill_and_drain() -> None:
    # K = 2, one unit per iteration: margin ceil((2 + 1) / 1) + 1 = 4 on each side, and
    # the window is max(4, margin) = 4 wide.
    assert steady_window(2, Plan.gpipe(1, 16)) == (12, 4, 8)
    # 16 units per iteration on 40 stages: margin ceil(41 / 16) + 1 = 4, window 4 (asked 3).
    assert steady_window(40, Plan.gpipe(16, 16), window=3) == (12, 4, 8)
    with pytest.raises(ValueError, match="at least one iteration"):
        steady_window(2, Plan.gpipe(1, 16), window=0)


def _timeline(rows: list[tuple[int, str, float, float]]) -> pd.DataFrame:
    return pd.DataFrame(
        [(r, r, 0, kind, -1, -1, start, end) for r, kind, start, end in rows],
        columns=["rank", "stage", "replica", "kind", "b", "t", "start", "end"],
    )


def test_update_ends_and_bubble_from_a_timeline() -> None:
    tl = _timeline(
        [
            (0, "F", 0.0, 2.0),
            (0, "OPT", 2.0, 3.0),
            (0, "SA", 3.0, 4.0),  # on the link: not busy unless sends block
            (0, "OPT", 6.0, 7.0),
            (1, "B", 1.0, 4.0),
            (1, "OPT", 4.0, 4.5),
            (1, "OPT", 5.0, 5.5),
        ]
    )
    assert list(update_ends(tl)) == [4.5, 7.0]  # the later rank's i-th update
    # Window [2, 6]: rank 0 busy 1 (OPT 2-3), rank 1 busy 2 + 0.5 + 0.5 = 3: idle 4 of 8.
    assert steady_bubble(tl, 2.0, 6.0) == pytest.approx(0.5)
    assert steady_bubble(tl, 2.0, 6.0, blocking_sends=True) == pytest.approx(3 / 8)
    with pytest.raises(ValueError, match="same number of times"):
        update_ends(tl.iloc[:-1])
