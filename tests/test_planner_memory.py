"""Tests for tplib.planner.memory and tplib.planner.memory_joint: memory-aware plans
against brute force.

The brute force shares no code with the planner: it lists every batch split and every
token slicing of each batch slice of a small problem, prices each plan's latency from
the cost table and its peak from the rule's definition, and keeps the fastest plan that
fits. Where the planner is exact (fill-drain, kept bytes proportional to tokens) its
latency equals the brute force's; elsewhere its plan fits and is no faster.
"""

from __future__ import annotations

import itertools
from functools import cache
from typing import Any

import numpy as np
import pytest

from tests.test_planner import compositions
from tplib.plan import Plan
from tplib.planner import NothingFitsError, TableCost, exact_joint, peak_bytes, plan_slices
from tplib.schedule import Kind, make_schedule

G = 8


class Bytes:
    """A memory model: ``per_token`` bytes kept per token, ``per_score`` per (token,
    key) pair up to the slice's end, working bytes from a table ``working[b - 1, k, j]``."""

    def __init__(
        self,
        per_token: float,
        per_score: float,
        working: np.ndarray,
        fixed: float,
        in_flight: int | None,
    ) -> None:
        self.per_token, self.per_score, self.table = per_token, per_score, working
        self.fixed, self.in_flight = fixed, in_flight

    def kept(self, batch_slice_size: int, length: np.ndarray, context: np.ndarray) -> np.ndarray:
        length, end = np.asarray(length, float), np.asarray(context, float) + length
        return batch_slice_size * length * (self.per_token + self.per_score * end)

    def working(self, batch_slice_size: int, length: np.ndarray, context: np.ndarray) -> np.ndarray:
        return self.table[batch_slice_size - 1, np.asarray(length) // G, np.asarray(context) // G]


@cache
def splits(batch: int, largest: int) -> tuple[tuple[int, ...], ...]:
    if batch == 0:
        return ((),)
    return tuple(
        (p, *rest) for p in range(min(batch, largest), 0, -1) for rest in splits(batch - p, p)
    )


def true_peak(mem: Bytes, sizes: tuple[int, ...], cuts: tuple[tuple[int, ...], ...]) -> float:
    """The rule's definition, unit by unit."""
    kept, working, most = [], [], 0
    for b, parts in zip(sizes, cuts, strict=True):
        context = 0
        for k in parts:
            kept.append(b * k * G * (mem.per_token + mem.per_score * (context + k * G)))
            working.append(float(mem.table[b - 1, k, context // G]))
            context += k * G
        most = max(most, len(parts))
    if mem.in_flight is not None:
        kept = sorted(kept)[-(mem.in_flight + most) :]
    return mem.fixed + sum(kept) + max(working)


def brute(
    times: np.ndarray, mem: Bytes, n: int, batch: int, k: int, capacity: float
) -> tuple[float, float]:
    """(least latency among plans whose peak fits, least peak of any plan)."""
    best, least = np.inf, np.inf
    for sizes in splits(batch, times.shape[0]):
        for cuts in itertools.product(compositions(n), repeat=len(sizes)):
            t = []
            for b, parts in zip(sizes, cuts, strict=True):
                context = np.cumsum((0, *parts[:-1]))
                t += [float(times[b - 1, x, c]) for x, c in zip(parts, context, strict=True)]
            peak = true_peak(mem, sizes, cuts)
            least = min(least, peak)
            if peak <= capacity:
                best = min(best, sum(t) + (k - 1) * max(t))
    return best, least


def problem(seed: int, per_score: float, in_flight: int | None, max_n: int = 6) -> tuple:
    rng = np.random.default_rng(seed)
    n, batch = int(rng.integers(2, max_n + 1)), int(rng.integers(1, 4))
    bmax, k = int(rng.integers(1, batch + 1)), int(rng.integers(1, 5))
    times = rng.uniform(0.1, 1.0, (bmax, n + 1, n + 1))
    working = rng.uniform(0, 5, times.shape) * (seed % 3 > 0)  # every third: none
    mem = Bytes(1.0, per_score, working, 3.0, in_flight)
    _, least = brute(times, mem, n, batch, k, np.inf)
    # Between the least peak and the fastest plan's: the limit binds where they differ.
    free = exact_joint(TableCost(times, G), seq_len=n * G, batch=batch, n_stages=k, granularity=G)
    capacity = least + rng.uniform(0.0, 1.0) * (peak_bytes(free, mem) - least)
    return times, mem, n, batch, k, capacity


def planned(times: np.ndarray, mem: Bytes, n: int, batch: int, k: int, capacity: float) -> Plan:
    return exact_joint(
        TableCost(times, G),
        seq_len=n * G,
        batch=batch,
        n_stages=k,
        granularity=G,
        memory=mem,
        capacity=capacity,
    )


def test_kept_bytes_proportional_to_tokens_give_the_fastest_plan_that_fits() -> None:
    for seed in range(12):
        times, mem, n, batch, k, capacity = problem(seed, 0.0, None)
        p = planned(times, mem, n, batch, k, capacity)
        best, _ = brute(times, mem, n, batch, k, capacity)
        assert p.latency == pytest.approx(best, abs=1e-9), seed
        assert peak_bytes(p, mem) <= capacity


@pytest.mark.parametrize(("per_score", "in_flight"), [(0.05, None), (0.0, 1), (0.05, 2)])
def test_conservative_plans_fit_and_are_no_faster_than_brute_force(
    per_score: float, in_flight: int | None
) -> None:
    # Scores kept (quadratic in a slice) or 1F1B's window: a feasible plan, not always
    # the fastest; or, for 1F1B only, no plan the planner can vouch for.
    found = 0
    for seed in range(8):
        times, mem, n, batch, k, capacity = problem(seed, per_score, in_flight, max_n=4)
        best, least = brute(times, mem, n, batch, k, capacity)
        try:
            p = planned(times, mem, n, batch, k, capacity)
        except NothingFitsError as exc:
            assert in_flight is not None and exc.smallest_peak <= least + 1e-9
            continue
        found += 1
        assert peak_bytes(p, mem) <= capacity
        assert true_peak(
            mem, p.batch_slices, tuple(tuple(s // G for s in ts) for ts in p.token_slices)
        ) == pytest.approx(peak_bytes(p, mem))
        assert p.latency is not None and p.latency >= best - 1e-9
    assert found >= 4


def test_nothing_fits_names_the_smallest_peak() -> None:
    times, mem, n, batch, k, _ = problem(4, 0.05, None)
    _, least = brute(times, mem, n, batch, k, np.inf)
    with pytest.raises(NothingFitsError, match=f"{least / 2**30:.3f} GiB") as info:
        planned(times, mem, n, batch, k, least * 0.999)
    assert info.value.smallest_peak == pytest.approx(least)
    p = planned(times, mem, n, batch, k, least)  # at exactly the least peak: that plan
    assert peak_bytes(p, mem) == pytest.approx(least)


@pytest.mark.parametrize(("per_score", "in_flight"), [(0.0, None), (0.05, None), (0.05, 3)])
def test_infinite_capacity_plans_as_without_memory(per_score: float, in_flight: int | None) -> None:
    for seed in range(4):
        times, mem, n, batch, k, _ = problem(seed, per_score, in_flight)
        free = exact_joint(
            TableCost(times, G), seq_len=n * G, batch=batch, n_stages=k, granularity=G
        )
        p = planned(times, mem, n, batch, k, np.inf)
        assert p == free and p.latency == pytest.approx(free.latency)


def test_peak_rules_by_hand() -> None:
    mem = Bytes(1.0, 0.0, np.full((2, 5, 5), 2.0), 10.0, None)
    p = Plan((1, 2), ((16, 16), (32,)))
    # fill-drain: every token's byte (16 + 16 + 2 x 32 = 96) + one unit's working.
    assert peak_bytes(p, mem) == 10 + 96 + 2
    # 1F1B with w = 0: the M = 2 largest units (2 x 32 = 64, then 16).
    mem.in_flight = 0
    assert peak_bytes(p, mem) == 10 + 64 + 16 + 2


def test_the_1f1b_rule_bounds_what_the_schedule_holds() -> None:
    # tplib's 1f1b on K stages holds at most K - 1 + M units at once on any stage.
    rng = np.random.default_rng(0)
    for _ in range(40):
        k, sizes = int(rng.integers(1, 6)), tuple(int(b) for b in rng.integers(1, 3, 3))
        cuts = [compositions(4)[int(rng.integers(8))] for _ in sizes]
        p = Plan(sizes, tuple(tuple(c * G for c in cut) for cut in cuts))
        mem = Bytes(1.0, 0.1, np.zeros((2, 5, 5)), 0.0, k - 1)
        kept = {
            u: float(
                mem.kept(
                    p.batch_slices[u.b],
                    np.array(p.token_slices[u.b][u.t]),
                    np.array(p.token_offset(u.b, u.t)),
                )
            )
            for u in p.units()
        }
        schedule = make_schedule("1f1b", k, p)
        for actions in schedule.actions:
            alive: set = set()
            for a in actions:
                if a.kind is Kind.F:
                    alive.add(a.unit)
                    assert sum(kept[u] for u in alive) <= peak_bytes(p, mem) + 1e-9
                elif a.kind is Kind.B:
                    alive.discard(a.unit)


def test_bad_input_is_refused() -> None:
    times, mem, n, batch, k, capacity = problem(1, 0.0, None)
    cost = TableCost(times, G)
    kw: dict[str, Any] = {"seq_len": n * G, "batch": batch, "n_stages": k, "granularity": G}
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="capacity="):
            exact_joint(cost, **kw, memory=mem, capacity=bad)
    with pytest.raises(ValueError, match="give both"):
        exact_joint(cost, **kw, memory=mem)
    with pytest.raises(ValueError, match="method='paper'"):
        plan_slices(cost, **kw, method="paper", memory=mem, capacity=capacity)
    mem.in_flight = -1
    with pytest.raises(ValueError, match="in_flight=-1"):
        exact_joint(cost, **kw, memory=mem, capacity=capacity)
    mem.in_flight, mem.table = None, -mem.table - 1
    with pytest.raises(ValueError, match="working bytes at batch=1, length=8"):
        exact_joint(cost, **kw, memory=mem, capacity=capacity)
