"""Tests for the planner's objective with virtual stages (tplib.planner.dp's
``fill_factor``, ``n_chunks`` in the token DP, the joint plans and
``pipeline_latency``): sum t + (K - 1) / v max t, checked by brute force over every
token slicing, and against the simulator's latency of the schedules it is for
(``terapipe-bfs``: exact when the units fill the ring, a lower bound otherwise;
``terapipe-interleaved``: a lower bound, exact on equal units in full groups)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.test_planner import TOL, G, batch_splits, compositions, slice_times, tables
from tplib.plan import Plan
from tplib.planner import TableCost, exact_joint, paper_joint, pipeline_latency, token_dp
from tplib.planner.dp import fill_factor
from tplib.schedule import make_schedule
from tplib.sim.costs import SliceCostModel
from tplib.sim.simulate import costs_from_slice_model, simulate


def brute_chunked(times_b: np.ndarray, n: int, k: int, v: int) -> float:
    """min over every slicing of sum t + (K - 1) / v max t, straight from the table."""
    ts = [slice_times(times_b, c) for c in compositions(n)]
    return min(sum(t) + (k - 1) / v * max(t) for t in ts)


def brute_chunked_joint(times: np.ndarray, n: int, batch: int, k: int, v: int) -> float:
    """The same over every batch split and every slicing of each batch slice."""
    best = np.inf
    for split in batch_splits(batch, min(batch, times.shape[0])):
        per = [[slice_times(times[b - 1], c) for c in compositions(n)] for b in split]
        for choice in np.ndindex(*(len(p) for p in per)):
            units = [t for p, i in zip(per, choice, strict=True) for t in p[i]]
            best = min(best, sum(units) + (k - 1) / v * max(units))
    return best


@settings(max_examples=60)
@given(tables(max_n=10, max_size=1), st.integers(1, 8), st.integers(1, 4))
def test_token_dp_with_chunks_matches_brute_force(
    table: tuple[np.ndarray, int], k: int, v: int
) -> None:
    times, n = table
    got = token_dp(TableCost(times, G), seq_len=n * G, n_stages=k, n_chunks=v)
    assert got.latency == pytest.approx(brute_chunked(times[0], n, k, v), abs=TOL)
    ts = slice_times(times[0], tuple(s // G for s in got.slices))
    assert got.latency == pytest.approx(sum(ts) + (k - 1) / v * max(ts), abs=TOL)


@settings(max_examples=30)
@given(tables(max_n=4, max_size=3), st.integers(1, 3), st.integers(1, 6), st.integers(2, 3))
def test_joint_plans_with_chunks_match_brute_force(
    table: tuple[np.ndarray, int], batch: int, k: int, v: int
) -> None:
    times, n = table
    cost = TableCost(times, G)
    got = exact_joint(cost, seq_len=n * G, batch=batch, n_stages=k, n_chunks=v)
    want = brute_chunked_joint(times, n, batch, k, v)
    assert got.latency == pytest.approx(want, abs=TOL)
    assert pipeline_latency(got, cost, k, n_chunks=v) == pytest.approx(want, abs=TOL)
    # The paper's knapsack counts the fill per batch slice: never better on the truth.
    paper = paper_joint(cost, seq_len=n * G, batch=batch, n_stages=k, n_chunks=v)
    assert pipeline_latency(paper, cost, k, n_chunks=v) >= want - TOL


def test_the_fill_term_shrinks_by_v() -> None:
    # Slices of 1, 2 and 4 seconds on K = 5 stages: 7 + 4 x 4 = 23, and 7 + 4 x 4 / 2.
    cost = TableCost(np.array([[[0, 0, 0], [1, 2, 0], [4, 0, 0]]], dtype=float), G)
    plan = Plan((1,), ((G, G),))
    assert pipeline_latency(plan, cost, 5) == 3 + 4 * 2
    assert pipeline_latency(plan, cost, 5, n_chunks=2) == 3 + 4 * 2 / 2
    assert fill_factor(5, 2) == 2.0 and fill_factor(1, 3) == 0.0
    with pytest.raises(ValueError, match="at least one chunk"):
        fill_factor(4, 0)


# ---- the objective against the simulated schedules --------------------------------------


class AttentionLike:
    """A per-slice overhead, tokens, and attention over the context: later slices cost
    more, as on a real layer."""

    max_batch_slice_size = None

    def slice_time(self, batch: int, length: np.ndarray, context: np.ndarray) -> np.ndarray:
        length, context = np.asarray(length, float), np.asarray(context, float)
        return 0.3 + batch * (0.05 * length + 0.002 * length * (context + length / 2))


def _simulated(name: str, k: int, v: int, plan: Plan, model: SliceCostModel) -> float:
    """Free communication, equal stages, F a third of each chunk's t / v."""
    sched = make_schedule(name, k, plan, n_chunks=v)
    return simulate(sched, costs_from_slice_model(model)).latency


@pytest.mark.parametrize(("k", "v", "n_seq"), [(2, 2, 1), (3, 2, 1), (3, 2, 2), (2, 3, 2)])
def test_breadth_first_latency_is_the_objective_when_the_units_fill_the_ring(
    k: int, v: int, n_seq: int
) -> None:
    """``terapipe-bfs`` on every slicing of 64 tokens: each chunk's round of units is a
    flow shop whose ring the units keep busy when sum t >= K max t; then the latency is
    sum t + (K - 1) / v max t exactly. Otherwise the ring idles, and it is a bound."""
    model, exact = AttentionLike(), 0
    for parts in compositions(8):
        plan = Plan((1,) * n_seq, (tuple(p * G for p in parts),) * n_seq)
        context = np.cumsum((0, *parts[:-1])) * G
        one = model.slice_time(1, np.array(parts) * G, context)
        t = np.tile(one, n_seq)  # every unit's t, straight from the cost model
        objective = pipeline_latency(plan, model, k, n_chunks=v)
        assert objective == pytest.approx(t.sum() + (k - 1) / v * t.max(), rel=1e-12)
        got = _simulated("terapipe-bfs", k, v, plan, model)
        if t.sum() >= k * t.max():
            assert got == pytest.approx(objective, rel=1e-12)
            exact += 1
        else:
            assert got > objective * (1 - 1e-12)
    assert exact > 0


@pytest.mark.parametrize(("k", "v", "n_seq"), [(2, 2, 2), (3, 2, 2), (2, 3, 2)])
def test_interleaved_latency_is_bounded_by_the_objective(k: int, v: int, n_seq: int) -> None:
    """``terapipe-interleaved`` on every slicing of 64 tokens with at least K units:
    never faster than the objective (its 1F1B order waits for token dependencies that
    breadth-first order never does)."""
    model = AttentionLike()
    for parts in compositions(8):
        plan = Plan((1,) * n_seq, (tuple(p * G for p in parts),) * n_seq)
        if plan.n_units < k:
            continue
        objective = pipeline_latency(plan, model, k, n_chunks=v)
        assert _simulated("terapipe-interleaved", k, v, plan, model) >= objective * (1 - 1e-12)


class Flat:
    """Every slice costs the same: 6 seconds."""

    max_batch_slice_size = None

    def slice_time(self, batch: int, length: np.ndarray, context: np.ndarray) -> np.ndarray:
        return np.full(np.shape(length), 6.0)


@pytest.mark.parametrize(
    ("k", "v", "n_seq", "m"), [(2, 2, 3, 2), (3, 2, 2, 3), (3, 3, 2, 3), (2, 2, 1, 8), (3, 2, 1, 9)]
)
def test_interleaved_latency_is_the_objective_on_equal_units_in_full_groups(
    k: int, v: int, n_seq: int, m: int
) -> None:
    """Equal units, each sequence cut into K token slices (or one sequence into a
    multiple of K): Megatron's (units + (K - 1) / v) x t."""
    plan = Plan.uniform(n_seq, m * G, n_token_slices=m)
    want = (n_seq * m + (k - 1) / v) * 6.0
    assert pipeline_latency(plan, Flat(), k, n_chunks=v) == pytest.approx(want)
    assert _simulated("terapipe-interleaved", k, v, plan, Flat()) == pytest.approx(want)
