"""Tests for tplib.planner.dp. The planner's objective with virtual stages
(``fill_factor``, ``n_chunks`` in the token DP, the joint plans and
``pipeline_latency``): sum t + (K - 1) / v max t, checked by brute force over every
token slicing, and against the simulator's latency of the schedules it is for
(``terapipe-bfs``: exact when the units fill the ring, a lower bound otherwise;
``terapipe-interleaved``: a lower bound, exact on equal units in full groups). And the
machinery: the vectorised DP against a plain one row at a time, the floor against every
slicing, the eps-windows, the branch and bound against trying every window, and the cost
grid kept per cost model (tplib.planner.cost_table)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.test_planner import (
    TOL,
    G,
    LinearCost,
    batch_splits,
    compositions,
    slice_times,
    tables,
)
from tplib.plan import Plan
from tplib.planner import (
    TableCost,
    exact_joint,
    paper_joint,
    pipeline_latency,
    plan_slices,
    token_dp,
)
from tplib.planner.cost_table import end_table
from tplib.planner.dp import bottleneck, fill_factor, run_dp, trace, windows
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


# ---- the vectorised DP and the t_max search, against plain references --------------------


def plain_dp(
    ce_b: np.ndarray, limit: float, values_b: np.ndarray | None = None
) -> tuple[float, float, tuple[int, ...]]:
    """Eq. 8 for one row, straight from the definition: S*(n), the largest slice time on
    the chosen slicing and its grid cuts, ties to the earliest start (run_dp's rule)."""
    n = ce_b.shape[0] - 1
    v = ce_b if values_b is None else values_b
    S, M, back = [0.0] + [np.inf] * n, [0.0] * (n + 1), [0] * (n + 1)
    for i in range(1, n + 1):
        for j in range(i):
            if ce_b[i, j] <= limit and S[j] + v[i, j] < S[i]:
                S[i], M[i], back[i] = S[j] + v[i, j], max(M[j], ce_b[i, j]), j
    cuts, i = [], n
    while i > 0 and np.isfinite(S[n]):
        cuts.append(i)
        i = back[i]
    return S[n], M[n], tuple(reversed(cuts))


def random_grid(rng: np.random.Generator, n: int, sizes: int, kind: str) -> np.ndarray:
    """A by-end grid ce[b, i, j] (b = 1..sizes, j < i): ties, random or growing costs,
    some cells forbidden (inf) as a memory limit leaves them."""
    i, j = np.meshgrid(np.arange(n + 1), np.arange(n + 1), indexing="ij")
    b = np.arange(sizes + 1)[:, None, None]
    if kind == "ties":
        ce = rng.integers(0, 4, (sizes + 1, n + 1, n + 1)).astype(float)
    else:
        ce = rng.random((sizes + 1, n + 1, n + 1))
        if kind == "grows":
            ce = 0.2 * ce + 0.5 + b * (i - j) * (1 + 0.1 * (i + j))
    if kind == "forbidden":
        ce[rng.random(ce.shape) < 0.2] = np.inf
    return np.where(j < i, ce, np.inf)


def test_run_dp_matches_a_plain_dp_row_by_row() -> None:
    """Many rows per sweep (band, blocks, pointer doubling) against one row at a time."""
    rng = np.random.default_rng(7)
    for case in range(160):
        n, sizes = int(rng.integers(1, 13)), int(rng.integers(1, 4))
        ce = random_grid(rng, n, sizes, ("ties", "random", "grows", "forbidden")[case % 4])
        values = ce + rng.integers(0, 3, ce.shape) if case % 5 == 0 else None
        r = int(rng.integers(1, 9))
        rows_b = rng.integers(1, sizes + 1, r)
        finite = ce[np.isfinite(ce)]
        rows_t = rng.choice(np.concatenate([finite, [np.inf, 0.0]]), r)
        S, M, back = run_dp(ce, rows_b, rows_t, values)
        for row in range(r):
            b = rows_b[row]
            want = plain_dp(ce[b], rows_t[row], None if values is None else values[b])
            assert S[row] == want[0]
            if np.isfinite(want[0]):
                assert M[row] == want[1]
                cuts = np.cumsum(trace(back[row], 1))
                assert tuple(cuts.tolist()) == want[2]


def test_bottleneck_is_the_least_largest_slice_of_any_slicing() -> None:
    rng = np.random.default_rng(8)
    for case in range(60):
        n, sizes = int(rng.integers(1, 9)), int(rng.integers(1, 3))
        ce = random_grid(rng, n, sizes, ("ties", "random", "grows", "forbidden")[case % 4])
        got = bottleneck(ce, np.arange(1, sizes + 1))
        for b in range(1, sizes + 1):
            ends = [np.cumsum(c) for c in compositions(n)]
            best = min(max(ce[b, e, s] for s, e in zip((0, *c[:-1]), c, strict=True)) for c in ends)
            assert got[b - 1] == best


def test_windows_chain_from_the_smallest_value() -> None:
    times = np.array([[0.1, 0.12, 0.2, 0.21, 0.25, 0.3, np.inf, 0.3]])
    starts, tops = windows(times, 0.05)
    assert starts.tolist() == [0.1, 0.2, 0.25, 0.3] and tops.tolist() == [0.12, 0.21, 0.25, 0.3]
    assert [a.tolist() for a in windows(times, 0.0)] == [[0.1, 0.12, 0.2, 0.21, 0.25, 0.3]] * 2
    # A tolerance below the values' spacing near 1e20 still moves on: one window each.
    starts, tops = windows(np.array([1e-30, 2e-30, 1e20]), 1e-20)
    assert starts.tolist() == [1e-30, 1e20] and tops.tolist() == [2e-30, 1e20]


def test_the_search_returns_the_best_window() -> None:
    """With eps > 0 the answer is the best T over every eps-window (each tried at its top),
    however the branch and bound orders and rules them out: every window tried at once,
    for one batch slice and for the joint plan (the split of least sum in each window, by
    brute force over splits)."""
    rng = np.random.default_rng(9)
    for case in range(24):
        n, sizes, batch = int(rng.integers(6, 17)), int(rng.integers(1, 4)), 3
        k, j = np.meshgrid(np.arange(n + 1), np.arange(n + 1), indexing="ij")
        b = np.arange(1, sizes + 1)[:, None, None]  # TableCost's times[b - 1, k, j]
        times = rng.random((sizes, n + 1, n + 1))
        if case % 2:  # overhead, tokens and attention, as a layer's time grows
            times = 0.2 * times + 0.5 + b * k * (1 + 0.1 * (2 * j + k))
        cost = TableCost(times, G)
        fill, eps = float(rng.integers(2, 40)), (1e-3, 0.05, 0.3)[case % 3]
        ce = end_table(cost, seq_len=n * G, max_batch_slice_size=sizes, granularity=G)
        rows_b = np.arange(1, sizes + 1)
        _, tops = windows(ce[1:2], eps)
        S, M, _ = run_dp(ce, np.ones(len(tops), dtype=int), tops)
        one = token_dp(cost, seq_len=n * G, n_stages=int(fill) + 1, eps=eps)
        assert one.latency == min(S + fill * M)
        _, tops = windows(ce[1:], eps)
        S, M, _ = run_dp(ce, np.tile(rows_b, len(tops)), np.repeat(tops, sizes))
        S, M = S.reshape(-1, sizes), M.reshape(-1, sizes)
        best = np.inf  # per window, the split of least sum (the knapsack's), then its T
        for w in range(len(tops)):
            split = min(batch_splits(batch, sizes), key=lambda d: sum(S[w, b - 1] for b in d))
            total = sum(S[w, b - 1] for b in split)
            best = min(best, total + fill * max(M[w, b - 1] for b in split))
        got = exact_joint(cost, seq_len=n * G, batch=batch, n_stages=int(fill) + 1, eps=eps)
        assert got.latency == pytest.approx(best, rel=1e-12)


# ---- the kept cost grid ---------------------------------------------------------------------


class CountingCost(LinearCost):
    """LinearCost that counts the cost model's calls, one per batch-slice size asked."""

    def __init__(self) -> None:
        self.asked: list[int] = []

    def slice_time(
        self, batch_slice_size: int, length: np.ndarray, context: np.ndarray
    ) -> np.ndarray:
        self.asked.append(batch_slice_size)
        return super().slice_time(batch_slice_size, length, context)


def test_the_cost_grid_is_asked_once_per_cost_model() -> None:
    cost = CountingCost()
    first = plan_slices(cost, seq_len=128, batch=3, n_stages=4, eps=1e-5)
    assert cost.asked == [1, 2, 3]
    # Planned again, or with fewer batch-slice sizes, from the kept grid: same plans.
    assert plan_slices(cost, seq_len=128, batch=3, n_stages=4, eps=1e-5) == first
    paper = plan_slices(cost, seq_len=128, batch=2, n_stages=4, method="paper")
    assert cost.asked == [1, 2, 3]
    fresh = CountingCost()
    assert plan_slices(fresh, seq_len=128, batch=2, n_stages=4, method="paper") == paper
    assert fresh.asked == [1, 2]
    # Another length is another grid; the kept one cannot be written to.
    plan_slices(cost, seq_len=64, batch=1, n_stages=4)
    assert cost.asked == [1, 2, 3, 1]
    ce = end_table(cost, seq_len=64, max_batch_slice_size=1, granularity=G)
    with pytest.raises(ValueError, match="read-only"):
        ce[1, 1, 0] = 0.0


def test_table_cost_keeps_its_own_copy_of_the_table() -> None:
    times = np.ones((1, 3, 3))
    cost = TableCost(times, G)
    times[0, 1, 0] = 5.0  # the caller's array; the model priced a plan before or not
    assert float(cost.slice_time(1, np.array(G), np.array(0))) == 1.0
