"""Tests for tplib.planner: every plan is checked against brute-force enumeration.

The brute force here shares no code with the planner: it lists every composition of the
grid (every token slicing) and every batch split, and scores them straight from the
cost table. Hypothesis draws the tables: random (non-monotone) costs, costs with many
ties, and costs that grow with the slice length and the context.
"""

from __future__ import annotations

import itertools
from functools import cache
from typing import Literal

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from tplib.plan import Plan
from tplib.planner import (
    TableCost,
    algorithm1,
    best_uniform,
    exact_joint,
    paper_joint,
    pipeline_latency,
    plan_slices,
    token_dp,
    uniform,
)

G = 8  # granularity used throughout
TOL = 1e-9


# ---- brute force ------------------------------------------------------------------------


@cache
def compositions(n: int) -> tuple[tuple[int, ...], ...]:
    """Every slicing of n grid units into positive parts, in order."""
    out = []
    for cuts in itertools.product((False, True), repeat=n - 1):
        parts, last = [], 0
        for pos, cut in enumerate(cuts, start=1):
            if cut:
                parts.append(pos - last)
                last = pos
        parts.append(n - last)
        out.append(tuple(parts))
    return tuple(out)


def slice_times(times_b: np.ndarray, parts: tuple[int, ...]) -> list[float]:
    """times_b[k, j]: k units long after j units of context."""
    context = np.cumsum((0, *parts[:-1]))
    return [float(times_b[k, j]) for k, j in zip(parts, context, strict=True)]


def sums_and_maxes(times_b: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    ts = [slice_times(times_b, c) for c in compositions(n)]
    return np.array([sum(t) for t in ts]), np.array([max(t) for t in ts])


def brute_token(times_b: np.ndarray, n: int, k: int) -> float:
    s, m = sums_and_maxes(times_b, n)
    return float(np.min(s + (k - 1) * m))


@cache
def batch_splits(batch: int, largest: int) -> tuple[tuple[int, ...], ...]:
    """Partitions of ``batch`` into parts <= largest, as non-increasing tuples."""
    if batch == 0:
        return ((),)
    return tuple(
        (p, *rest) for p in range(min(batch, largest), 0, -1) for rest in batch_splits(batch - p, p)
    )


def brute_exact_joint(times: np.ndarray, n: int, batch: int, k: int, bmax: int) -> float:
    """min over batch splits and per-batch-slice slicings of sum(all t) + (K-1) max(all t)."""
    per_b = {b: sums_and_maxes(times[b - 1], n) for b in range(1, bmax + 1)}
    best = np.inf
    for split in batch_splits(batch, bmax):
        total, peak = np.zeros(()), np.zeros(())
        for b in split:  # one new broadcast axis per batch slice: every combination
            total = total[..., None] + per_b[b][0]
            peak = np.maximum(peak[..., None], per_b[b][1])
        best = min(best, float(np.min(total + (k - 1) * peak)))
    return best


def brute_paper_joint(times: np.ndarray, n: int, batch: int, k: int, bmax: int) -> float:
    """min over batch splits of sum_d T*_{b_d} (each batch slice's own Eq. 5 optimum)."""
    t_best = {b: brute_token(times[b - 1], n, k) for b in range(1, bmax + 1)}
    return min(sum(t_best[b] for b in split) for split in batch_splits(batch, bmax))


def plan_objective(times: np.ndarray, p: Plan, k: int) -> float:
    """True fill-drain latency of a plan, read straight from the table."""
    ts = [
        t
        for b, tokens in zip(p.batch_slices, p.token_slices, strict=True)
        for t in slice_times(times[b - 1], tuple(s // G for s in tokens))
    ]
    return sum(ts) + (k - 1) * max(ts)


# ---- cost tables ----------------------------------------------------------------------


@st.composite
def tables(draw: st.DrawFn, max_n: int, max_size: int) -> tuple[np.ndarray, int]:
    """(times, n): times[b - 1, k, j] for batch slice sizes b <= max_size and
    k + j <= n <= max_n."""
    n = draw(st.integers(1, max_n))
    n_b = draw(st.integers(1, max_size))
    shape = (n_b, n + 1, n + 1)
    kind = draw(st.sampled_from(["random", "ties", "grows"]))
    if kind == "ties":  # few distinct values: many equal t_max candidates and equal sums
        times = draw(hnp.arrays(np.int64, shape, elements=st.integers(0, 4))).astype(float)
    else:
        times = draw(hnp.arrays(float, shape, elements=st.floats(0, 1, width=32)))
    if kind == "grows":  # overhead + length + attention over the context (paper Eq. 9)
        k, j = np.meshgrid(np.arange(n + 1), np.arange(n + 1), indexing="ij")
        b = np.arange(1, n_b + 1)[:, None, None]
        a = draw(st.floats(0, 1))
        times = 0.1 * times + 0.5 + a * b * k + 0.1 * b * k * (j + k / 2)
    return times, n


# ---- token DP ---------------------------------------------------------------------------


@settings(max_examples=80)
@given(tables(max_n=12, max_size=2), st.integers(1, 9), st.data())
def test_token_dp_matches_brute_force(
    table: tuple[np.ndarray, int], k: int, data: st.DataObject
) -> None:
    times, n = table
    b = data.draw(st.integers(1, times.shape[0]))
    got = token_dp(TableCost(times, G), seq_len=n * G, n_stages=k, batch_slice_size=b)
    assert got.latency == pytest.approx(brute_token(times[b - 1], n, k), abs=TOL)
    # The returned slicing really has the returned cost.
    assert sum(got.slices) == n * G and all(s % G == 0 and s > 0 for s in got.slices)
    ts = slice_times(times[b - 1], tuple(s // G for s in got.slices))
    assert got.t_max == pytest.approx(max(ts), abs=TOL)
    assert got.total == pytest.approx(sum(ts), abs=TOL)
    assert got.latency == pytest.approx(sum(ts) + (k - 1) * max(ts), abs=TOL)


@settings(max_examples=60)
@given(tables(max_n=10, max_size=1), st.data())
def test_algorithm1_matches_brute_force(table: tuple[np.ndarray, int], data: st.DataObject) -> None:
    """Eq. 7: least total time over slicings whose every slice fits under t_max."""
    times, n = table
    values = sorted({float(x) for x in times[0][np.add.outer(range(n + 1), range(n + 1)) <= n]})
    t_max = data.draw(st.sampled_from(values) | st.floats(0, 2 * values[-1] + 1))
    s, m = sums_and_maxes(times[0], n)
    want = float(np.min(np.where(m <= t_max, s, np.inf)))
    total, slices = algorithm1(TableCost(times, G), seq_len=n * G, t_max=t_max)
    assert total == pytest.approx(want, abs=TOL)
    if np.isfinite(want):
        ts = slice_times(times[0], tuple(x // G for x in slices))
        assert max(ts) <= t_max and sum(ts) == pytest.approx(want, abs=TOL)
    else:
        assert slices == ()


@settings(max_examples=80)
@given(tables(max_n=10, max_size=1), st.integers(1, 9), st.floats(0, 3))
def test_eps_stays_within_k_eps(table: tuple[np.ndarray, int], k: int, eps: float) -> None:
    times, n = table
    got = token_dp(TableCost(times, G), seq_len=n * G, n_stages=k, eps=eps)
    best = brute_token(times[0], n, k)
    assert best - TOL <= got.latency <= best + k * eps + TOL
    ts = slice_times(times[0], tuple(s // G for s in got.slices))
    assert got.latency == pytest.approx(sum(ts) + (k - 1) * max(ts), abs=TOL)


def test_eps_window_keeps_the_bound_where_trying_its_first_value_would_not() -> None:
    """Candidates 1.0, 1.05, 1.9 with eps=0.1: trying 1.0 (infeasible) then skipping 1.05
    would leave only 1.9, i.e. the single slice (T=19 with K=10); the optimum is 11.5."""
    times = np.full((1, 3, 3), 5.0)
    times[0, 1, 0], times[0, 1, 1], times[0, 2, 0] = 1.0, 1.05, 1.9
    got = token_dp(TableCost(times, G), seq_len=2 * G, n_stages=10, eps=0.1)
    assert got.slices == (G, G)
    assert got.latency == pytest.approx(2.05 + 9 * 1.05)


# ---- joint plans ------------------------------------------------------------------------


@settings(max_examples=60)
@given(tables(max_n=5, max_size=4), st.integers(1, 4), st.integers(1, 6), st.data())
def test_joint_plans_match_brute_force(
    table: tuple[np.ndarray, int], batch: int, k: int, data: st.DataObject
) -> None:
    times, n = table
    cost = TableCost(times, G)
    limit = data.draw(st.none() | st.integers(1, times.shape[0]))
    bmax = min(batch, times.shape[0], limit or batch)
    exact, paper = (
        joint(
            cost, seq_len=n * G, batch=batch, n_stages=k, granularity=G, max_batch_slice_size=limit
        )
        for joint in (exact_joint, paper_joint)
    )
    for p in (exact, paper):
        p.check_covers(batch, n * G)
        assert max(p.batch_slices) <= bmax
        assert all(s % G == 0 for ts in p.token_slices for s in ts)
        units = [
            t
            for b, ts in zip(p.batch_slices, p.token_slices, strict=True)
            for t in slice_times(times[b - 1], tuple(s // G for s in ts))
        ]
        assert p.t_max == pytest.approx(max(units), abs=TOL)
    want = brute_exact_joint(times, n, batch, k, bmax)
    assert exact.latency is not None
    assert exact.latency == pytest.approx(want, abs=TOL)
    assert plan_objective(times, exact, k) == pytest.approx(want, abs=TOL)
    assert paper.latency == pytest.approx(brute_paper_joint(times, n, batch, k, bmax), abs=TOL)
    # On the true latency the paper's plan can only tie or lose against the exact one.
    assert pipeline_latency(paper, cost, k) >= exact.latency - TOL


@settings(max_examples=40)
@given(tables(max_n=5, max_size=3), st.integers(1, 4), st.integers(1, 6), st.floats(0, 2))
def test_joint_eps_stays_within_k_eps(
    table: tuple[np.ndarray, int], batch: int, k: int, eps: float
) -> None:
    times, n = table
    got = exact_joint(TableCost(times, G), seq_len=n * G, batch=batch, n_stages=k, eps=eps)
    best = brute_exact_joint(times, n, batch, k, min(batch, times.shape[0]))
    assert got.latency is not None
    assert best - TOL <= got.latency <= best + k * eps + TOL


Method = Literal["exact", "paper"]


class LinearCost:
    """GPU-like analytic cost for any batch slice: flat below 64 tokens, attention term."""

    max_batch_slice_size = None

    def slice_time(
        self, batch_slice_size: int, length: np.ndarray, context: np.ndarray
    ) -> np.ndarray:
        tokens = batch_slice_size * np.asarray(length, dtype=float)
        return 1e-3 + 1e-5 * np.maximum(tokens, 64) + 1e-8 * tokens * (context + length / 2)


@pytest.mark.parametrize("method", ["exact", "paper"])
def test_plan_output_covers_the_batch_and_reports_its_latency(method: Method) -> None:
    cost = LinearCost()
    p = plan_slices(cost, seq_len=256, batch=6, n_stages=4, method=method, eps=1e-5)
    p.check_covers(6, 256)
    assert all(s % 8 == 0 for ts in p.token_slices for s in ts)
    assert p.eps == 1e-5
    # t_max is the largest unit time of the plan itself.
    units = [
        float(cost.slice_time(b, np.array(s), np.array(c)))
        for b, ts in zip(p.batch_slices, p.token_slices, strict=True)
        for s, c in zip(ts, np.cumsum((0, *ts[:-1])), strict=True)
    ]
    assert p.t_max == pytest.approx(max(units))
    true = sum(units) + 3 * max(units)
    assert pipeline_latency(p, cost, 4) == pytest.approx(true)
    if method == "exact":
        assert p.latency == pytest.approx(true)
        # Optimal on the true latency: no uniform slicing (any batch slice size) beats it.
        for size in (1, 2, 3, 6):
            latency = best_uniform(cost, 256, 6, 4, batch_slice_size=size).latency
            assert latency is not None and latency >= true - 1e-12


def test_batch_slices_respect_the_cost_models_and_the_callers_limit() -> None:
    times = np.ones((2, 3, 3))  # profiled for batch slices of 1 and 2 only
    p = plan_slices(TableCost(times, G), seq_len=16, batch=5, n_stages=3)
    p.check_covers(5, 16)
    assert max(p.batch_slices) <= 2
    q = plan_slices(
        LinearCost(), seq_len=64, batch=5, n_stages=3, max_batch_slice_size=1, method="paper"
    )
    assert q.batch_slices == (1,) * 5


# ---- uniform baseline and pipeline_latency -------------------------------------------------


def test_uniform_slices_as_equal_as_the_grid_allows() -> None:
    times = np.arange(2 * 6 * 6, dtype=float).reshape(2, 6, 6) / 100
    cost = TableCost(times, G)
    p = uniform(cost, 40, 4, 3, n_slices=2, batch_slice_size=2)
    assert p.batch_slices == (2, 2) and p.token_slices == ((24, 16), (24, 16))
    t = [times[1, 3, 0], times[1, 2, 3]] * 2
    assert p.latency == pytest.approx(sum(t) + 2 * max(t))
    best = best_uniform(cost, 40, 4, 3)
    assert best.latency == min(_latency(uniform(cost, 40, 4, 3, m)) for m in (1, 2, 4))


def _latency(p: Plan) -> float:
    assert p.latency is not None
    return p.latency


def test_pipeline_latency_reads_plans_in_every_form() -> None:
    cost = LinearCost()
    text = "[(1, [776, 640, 632])] * 2"
    pairs = [(1, [776, 640, 632])] * 2
    want = pipeline_latency(Plan.from_paper(text), cost, 5)
    assert pipeline_latency(text, cost, 5) == want == pipeline_latency(pairs, cost, 5)


# ---- bad input ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("bad", "rule"), [(np.nan, "NaN"), (-1.0, "negative"), (np.inf, "infinite")]
)
def test_bad_costs_name_the_slice_and_the_rule(bad: float, rule: str) -> None:
    times = np.ones((2, 4, 4))
    times[1, 2, 1] = bad  # batch 2, 16 tokens after 8 tokens of context
    with pytest.raises(ValueError, match=rf"{rule} slice time .* batch=2, length=16, context=8"):
        plan_slices(TableCost(times, G), seq_len=24, batch=2, n_stages=2)
    with pytest.raises(ValueError, match=rf"{rule} slice time"):
        pipeline_latency([(2, [8, 16])], TableCost(times, G), 2)


def test_bad_arguments_are_refused_with_the_value() -> None:
    cost = TableCost(np.ones((2, 4, 4)), G)
    with pytest.raises(
        ValueError, match="seq_len L=20 is not a positive multiple of granularity g=8"
    ):
        plan_slices(LinearCost(), seq_len=20, batch=1, n_stages=2)
    with pytest.raises(ValueError, match="n_stages K=0"):
        plan_slices(cost, seq_len=24, batch=1, n_stages=0)
    with pytest.raises(ValueError, match="n_stages K=-1"):
        pipeline_latency([(1, [24])], cost, -1)
    with pytest.raises(ValueError, match=r"eps=-0\.1"):
        plan_slices(cost, seq_len=24, batch=1, n_stages=2, eps=-0.1)
    with pytest.raises(ValueError, match="method='fast'"):
        plan_slices(cost, seq_len=24, batch=1, n_stages=2, method="fast")  # type: ignore[arg-type]


def test_batch_slices_beyond_the_cost_model_are_refused() -> None:
    cost = TableCost(np.ones((2, 4, 4)), G)  # profiled up to batch slices of 2
    assert cost.max_batch_slice_size == 2
    exceeds = r"batch slice of 3 sequences exceeds .* max_batch_slice_size=2"
    with pytest.raises(ValueError, match=exceeds):
        token_dp(cost, seq_len=24, n_stages=2, batch_slice_size=3)
    with pytest.raises(ValueError, match=exceeds):
        algorithm1(cost, seq_len=24, t_max=1.0, batch_slice_size=3)
    with pytest.raises(ValueError, match=exceeds):
        uniform(cost, 24, 3, 2, n_slices=1, batch_slice_size=3)
    with pytest.raises(ValueError, match=r"max_batch_slice_size=3 is outside 1\.\.2"):
        plan_slices(cost, seq_len=24, batch=3, n_stages=2, max_batch_slice_size=3)
    with pytest.raises(ValueError, match=r"max_batch_slice_size=0 is outside 1 or more"):
        plan_slices(LinearCost(), seq_len=24, batch=3, n_stages=2, max_batch_slice_size=0)


def test_one_stage_plans_when_small_limits_fit_only_larger_batch_slices() -> None:
    """K = 1 (no fill term): limits under which only batch slices of 2 fit leave an odd
    batch without a split; those tries must not hide the plans found beside them."""
    rng = np.random.default_rng(3)
    for _ in range(20):
        times = rng.random((2, 6, 6))
        times[0] += 0.5  # one sequence alone costs more than two together
        got = exact_joint(TableCost(times, G), seq_len=5 * G, batch=3, n_stages=1)
        assert got.latency == pytest.approx(brute_exact_joint(times, 5, 3, 1, 2), abs=TOL)
