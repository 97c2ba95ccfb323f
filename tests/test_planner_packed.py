"""The packed-batch planner: its cost model, its DP against brute force, the snap rule
and the plan cache (tplib/planner/packed_cost.py, packed.py, plan_cache.py).

The brute force prices every unit from :meth:`Documents.segments` (a segment of ``l``
tokens after ``c`` of its document sees ``l c + l (l + 1) / 2`` pairs), not from the
pairs prefix the planner reads, and tries every contiguous batch split and every slicing.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from tests.test_planner import compositions
from tplib.documents import Documents
from tplib.plan import Plan
from tplib.planner import (
    PackedCost,
    PlanCache,
    exact_joint,
    packed_latency,
    plan_packed,
    snap_uniform,
)

Linear = tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...]]


def random_cost(
    rng: np.random.Generator, bmax: int, per_token: float = 1.0, seq_len: int = 48
) -> tuple[PackedCost, Linear]:
    """A linear cost ``a_b + alpha_b l + gamma_b pairs``, and its coefficients."""
    b = np.arange(1, bmax + 1)
    # More rows per batch slice: more work, less per row (the overhead is shared).
    coef = (
        tuple(rng.uniform(0.5, 2.0, bmax) * (1 + 0.2 * b)),
        tuple(rng.uniform(0.02, 0.1, bmax) * b * per_token),
        tuple(rng.uniform(1e-3, 5e-3, bmax) * b),
    )
    return PackedCost.linear(*coef, seq_len=seq_len), coef


def random_documents(rng: np.random.Generator, batch: int, seq_len: int) -> Documents:
    rows = []
    for _ in range(batch):
        inner = rng.choice(np.arange(1, seq_len), size=rng.integers(0, 5), replace=False)
        rows.append((0, *sorted(int(x) for x in inner), seq_len))
    return Documents(tuple(rows), seq_len)


def segment_time(cost: Linear, docs: Documents, start: int, end: int) -> float:
    """One unit's time from its segments: the reference for the pairs prefix."""
    pairs = sum(
        s.context * (s.hi - s.lo) + (s.hi - s.lo) * (s.hi - s.lo + 1) / 2
        for s in docs.segments(start, end)
    )
    b = docs.batch
    intercept, per_token, per_pair = cost
    return intercept[b - 1] + per_token[b - 1] * (end - start) + per_pair[b - 1] * pairs / b


def brute_force(cost: Linear, docs: Documents, fill: float, bmax: int, g: int) -> float:
    """The least sum t + fill * max t over every contiguous split and every slicing."""
    n, best = docs.seq_len // g, np.inf
    for split in compositions(docs.batch):
        if max(split) > bmax:
            continue
        sums, maxes, first = [], [], 0
        for size in split:
            rows = docs.rows(first, size)
            first += size
            t = [
                [
                    segment_time(cost, rows, g * c0, g * c1)
                    for c0, c1 in itertools.pairwise(np.cumsum((0, *parts)))
                ]
                for parts in compositions(n)
            ]
            sums.append(np.array([sum(x) for x in t]))
            maxes.append(np.array([max(x) for x in t]))
        total, peak = sums[0], maxes[0]
        for s, m in zip(sums[1:], maxes[1:], strict=True):
            total, peak = np.add.outer(total, s), np.maximum.outer(peak, m)
        best = min(best, float((total + fill * peak).min()))
    return best


@pytest.mark.parametrize("seed", range(12))
def test_plan_packed_is_the_brute_force_optimum(seed: int) -> None:
    rng = np.random.default_rng(seed)
    batch, seq_len = 1 + seed % 3, (32, 40, 48)[seed % 3]
    bmax = int(rng.integers(1, batch + 1))
    # Every fourth case a (small) negative token term: the search's bound steps aside.
    cost, coef = random_cost(rng, 3, per_token=-0.1 if seed % 4 == 3 else 1.0, seq_len=seq_len)
    docs = random_documents(rng, batch, seq_len)
    n_stages = int(rng.integers(1, 9))
    plan = plan_packed(cost, docs, n_stages=n_stages, max_batch_slice_size=bmax)
    assert plan.latency == pytest.approx(brute_force(coef, docs, n_stages - 1, bmax, 8), rel=1e-9)
    assert max(plan.batch_slices) <= bmax
    assert packed_latency(plan, cost, docs, n_stages) == pytest.approx(plan.latency, rel=1e-12)
    # The cost grid the DP reads is the segments' reference, cell by cell.
    rows = docs.rows(0, batch)
    grid = cost.grid(rows, 8)
    for i, j in itertools.combinations(range(seq_len // 8 + 1), 2):
        assert grid[j, i] == pytest.approx(segment_time(coef, rows, 8 * i, 8 * j), rel=1e-12)
    assert np.isinf(grid[np.triu_indices(seq_len // 8 + 1)]).all()


def test_whole_rows_plan_as_exact_joint_on_the_fitted_cost() -> None:
    """Unpacked rows: the same objective as exact_joint (its split sorted, ours in row
    order), on a cost fitted from a model with a host floor (which the fit follows: a
    slice without context costs the model's own time)."""

    class Floored:
        max_batch_slice_size = 3

        def slice_time(self, b: int, length: np.ndarray, context: np.ndarray) -> np.ndarray:
            length, context = np.asarray(length, float), np.asarray(context, float)
            return (
                1.0 + 0.05 * np.maximum(b * length, 24) + 2e-3 * b * length * (context + length / 2)
            )

    fitted = PackedCost.fit(Floored(), seq_len=64, max_batch_slice_size=3)
    assert fitted.residual < 1e-9
    for n_stages, n_chunks in ((4, 1), (6, 2)):
        ours = plan_packed(fitted, Documents.whole(3, 64), n_stages=n_stages, n_chunks=n_chunks)
        theirs = exact_joint(fitted, seq_len=64, batch=3, n_stages=n_stages, n_chunks=n_chunks)
        assert ours.latency == pytest.approx(theirs.latency, rel=1e-12)


def test_fit_recovers_a_model_of_its_own_form() -> None:
    cost = PackedCost.linear((1.0, 1.5), (0.1, 0.18), (1e-3, 2e-3), seq_len=64)
    fitted = PackedCost.fit(cost, seq_len=64, max_batch_slice_size=2, granularity=8)
    assert fitted.per_pair == pytest.approx(cost.per_pair, rel=1e-9)
    for ours, theirs in zip(fitted.pair_free, cost.pair_free, strict=True):
        assert ours[1:] == pytest.approx(theirs[1:], rel=1e-9)
    assert fitted.residual < 1e-9


def test_fit_keeps_a_floor_on_slices_without_context() -> None:
    """A host floor the model has below 24 tokens: slices without context cost exactly
    the model's time, and context adds its fitted slope."""

    class Floored:
        max_batch_slice_size = 1

        def slice_time(self, b: int, length: np.ndarray, context: np.ndarray) -> np.ndarray:
            length, context = np.asarray(length, float), np.asarray(context, float)
            return 1.0 + 0.05 * np.maximum(length, 24) + 2e-3 * length * (context + length / 2)

    fitted = PackedCost.fit(Floored(), seq_len=64, max_batch_slice_size=1)
    lengths = np.arange(8, 65, 8)
    model = Floored().slice_time(1, lengths, 0 * lengths)
    assert fitted.slice_time(1, lengths, 0 * lengths) == pytest.approx(model, rel=1e-12)
    assert fitted.per_pair[0] == pytest.approx(2e-3, rel=1e-9)


def test_eps_keeps_its_bound_and_bad_input_is_refused() -> None:
    rng = np.random.default_rng(7)
    cost, docs = random_cost(rng, 2)[0], random_documents(rng, 3, 48)
    exact = packed_latency(plan_packed(cost, docs, n_stages=4), cost, docs, 4)
    eps = 0.05
    loose = packed_latency(plan_packed(cost, docs, n_stages=4, eps=eps), cost, docs, 4)
    assert exact <= loose <= exact + 3 * eps + 1e-12
    with pytest.raises(ValueError, match="max_batch_slice_size=3"):
        plan_packed(cost, docs, n_stages=4, max_batch_slice_size=3)
    with pytest.raises(ValueError, match="eps=-1"):
        plan_packed(cost, docs, n_stages=4, eps=-1)
    with pytest.raises(ValueError, match="granularity"):
        plan_packed(cost, docs, n_stages=4, granularity=7)
    with pytest.raises(ValueError, match="3 rows"):
        cost.unit_time(docs, 0, 8)


def test_snap_uniform_moves_cuts_to_nearby_document_boundaries() -> None:
    docs = Documents(((0, 21, 64), (0, 40, 64), (0, 5, 64)), 64)
    # Row 0: the cut at 32 moves to 21, rounded to the grid: 24.
    assert snap_uniform(docs.rows(0, 1), 2).token_slices == ((24, 40),)
    assert snap_uniform(docs.rows(0, 1), 2, window=4).token_slices == ((32, 32),)
    # Rows 0 and 1 together: 24 and 40 both 8 away, the earlier wins.
    assert snap_uniform(docs, 2, batch_slices=(2, 1)).token_slices == ((24, 40), (32, 32))
    # A cut whose only candidate is not past the cut before stays; window=0 is uniform.
    four = snap_uniform(Documents(((0, 20, 64),), 64), 4, window=16)
    assert four.token_slices == ((24, 8, 16, 16),)
    assert snap_uniform(docs, 4, window=0) == Plan.uniform(3, 64, n_token_slices=4)
    assert snap_uniform(docs, 2, batch_slices=2).batch_slices == (2, 1)
    with pytest.raises(ValueError, match="n_slices=9"):
        snap_uniform(docs, 9)
    with pytest.raises(ValueError, match="cover the batch of 3"):
        snap_uniform(docs, 2, batch_slices=(1, 1))


def test_plan_cache_keys_by_rounded_pattern() -> None:
    a = Documents(((0, 21, 64), (0, 64)), 64)
    near = Documents(((0, 19, 64), (0, 2, 64)), 64)  # 19 -> 16 vs 21 -> 24; 2 -> 0
    planned: list[Documents] = []

    def plan(d: Documents) -> Plan:
        planned.append(d)
        return snap_uniform(d, 2)

    fine, coarse = PlanCache(), PlanCache(bucket=64)
    for d in (a, near, a):
        fine.get_or_plan(d, plan)
        coarse.get_or_plan(d, plan)
    assert (fine.hits, fine.misses, len(fine)) == (1, 2, 2)
    assert (coarse.hits, coarse.misses) == (2, 1) and coarse.hit_rate == pytest.approx(2 / 3)
    assert PlanCache(bucket=16).key(a) == PlanCache(bucket=16).key(near)
    lru = PlanCache(maxsize=1)
    for d in (a, near, a):
        lru.get_or_plan(d, plan)
    assert (lru.misses, len(lru)) == (3, 1)
    with pytest.raises(ValueError, match="cover"):
        PlanCache().get_or_plan(a, lambda d: Plan.uniform(3, 64))
    with pytest.raises(ValueError, match="bucket=4"):
        PlanCache(bucket=4)
