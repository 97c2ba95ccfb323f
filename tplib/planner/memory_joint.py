"""The memory-aware joint planner: the fastest plan whose peak fits a GPU's memory.

:func:`fitting_joint` minimises the same fill-drain latency as
:func:`~tplib.planner.joint.exact_joint` (one ``t_max`` for all units, a knapsack over
the batch split) over the plans whose peak, by a :class:`~tplib.planner.memory.SliceMemory`
and its schedule's rule (:func:`~tplib.planner.memory.peak_bytes`), fits ``capacity``
bytes. A memory limit on one slice is exact in the DP: the slices it forbids become
infinite cells of the cost grid before the search (:mod:`tplib.planner.knapsack`). How
the peak's other terms are met, case by case:

- **Fill-drain, kept bytes proportional to tokens** (``kept = r * b * l``: activations
  under FlashAttention or selective recomputation, unit inputs under full
  recomputation). ``sum_u kept`` is ``r * B * L`` for every plan, so the peak is
  ``fixed + r B L + max working`` and the rule is a limit per slice on the working
  bytes. **Exact**: the fastest plan that fits (within the usual ``(K - 1) eps``).
- **Fill-drain, any other kept bytes** (attention scores kept without recomputation:
  ``l (c + l)`` per unit, quadratic in the slice). The sum is additive over slices, a
  constrained shortest path that the DP cannot bound exactly. The planner takes the
  fastest plan if it fits; else the plan with the least peak (found exactly: the same
  search with kept bytes summed and working bytes as the limit) is the fallback, so a
  plan is found whenever one fits, and better ones are sought by minimising
  ``latency + lambda * sum kept`` (lambda by x4 steps, then bisection; working bytes
  limited per slice) and by limits on each slice's kept bytes, each answer counted only
  if its true peak fits. **Feasible, not necessarily the fastest.**
- **1F1B** (``in_flight = w``). The peak sums the ``w + M`` largest kept bytes, M the
  most token slices of a batch slice. The fastest plan is taken if it fits. Else,
  sufficient limits per slice: every slice at least ``ceil(n / m)`` grid steps (so
  M <= m), kept bytes at most ``a``, working bytes at most ``omega``, with
  ``(w + m) a + omega <= capacity - fixed``, for m = 1, 2, ..., 16, then powers of two,
  and a among the kept bytes' values (quantiles); each an exact search of its own
  masked grid, pruned by the best plan so far. Then, near the best m, looser limits
  (a up to the whole budget, by bisection) whose plans count only if their true peak
  fits. **Feasible, not necessarily the fastest** (exact where no unit keeps bytes).

Every returned plan's peak is checked by :func:`~tplib.planner.memory.peak_bytes`. When
none fits, :class:`~tplib.planner.memory.NothingFitsError` names the least peak any plan
attains (fill-drain, exact), or for 1F1B a lower bound on it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from tplib.plan import Plan
from tplib.planner.cost_table import by_end
from tplib.planner.dp import bottleneck, fill_factor, prepare, run_dp
from tplib.planner.knapsack import JointResult, joint_search
from tplib.planner.memory import (
    NothingFitsError,
    SliceMemory,
    check_rule,
    memory_grids,
    peak_bytes,
)
from tplib.sim.costs import SliceCostModel

__all__ = ["fitting_joint"]

GIB = 2**30
# 1F1B: the bounds M <= m tried one by one up to this grid size (powers of two beyond),
# and the per-slice limits on kept bytes tried for each m.
MAX_CANDIDATES, A_VALUES = 16, 8
LAMBDA_STEPS, BISECTIONS = 24, 8  # the Lagrangian search: x4 steps, then halvings


@dataclass(frozen=True)
class _Problem:
    """The grids (by end, as the DP reads them) and the objective's terms."""

    ce: np.ndarray
    kept: np.ndarray
    working: np.ndarray
    batch: int
    fill: float
    eps: float
    granularity: int
    extra: np.ndarray
    fixed: float

    def search(self, ce: np.ndarray, **kw: Any) -> JointResult | None:
        return joint_search(
            ce,
            batch=self.batch,
            fill=self.fill,
            eps=self.eps,
            granularity=self.granularity,
            extra=self.extra,
            **kw,
        )

    def units(self, r: JointResult) -> tuple[list[float], list[float], list[float]]:
        """(times, kept, working) of every unit of ``r``'s plan, read off the grids."""
        t, k, w = [], [], []
        for b, ts in zip(r.sizes, r.slicings, strict=True):
            i = np.cumsum(ts) // self.granularity
            j = i - np.asarray(ts) // self.granularity
            t += self.ce[b, i, j].tolist()
            k += self.kept[b, i, j].tolist()
            w += self.working[b, i, j].tolist()
        return t, k, w

    def latency(self, r: JointResult) -> float:
        t, _, _ = self.units(r)
        return sum(t) + sum(self.extra[b - 1] for b in r.sizes) + self.fill * max(t)

    def window_peak(self, r: JointResult, w: int) -> float:
        """The 1F1B peak of ``r``'s plan: the w + M largest kept bytes."""
        _, k, wk = self.units(r)
        held = sorted(k)[-(w + max(map(len, r.slicings))) :]
        return self.fixed + sum(held) + max(wk)

    def peak(self, r: JointResult) -> float:
        """The fill-drain peak of ``r``'s plan."""
        _, k, w = self.units(r)
        return self.fixed + sum(k) + max(w)


def _masked(ce: np.ndarray, forbid: np.ndarray) -> np.ndarray:
    return np.where(forbid, np.inf, ce)


def _per_token(kept: np.ndarray, granularity: int) -> float | None:
    """r if every finite cell holds ``r * b * l`` bytes (l in tokens), else None."""
    b = np.arange(kept.shape[0])[:, None, None]
    i, j = np.indices(kept.shape[1:])
    tokens = b * (i - j) * granularity
    ok = np.isfinite(kept) & (tokens > 0)
    rate = kept[ok] / tokens[ok]
    if not len(rate) or np.ptp(rate) > 1e-12 * max(rate.max(), 1e-300):
        return None
    return float(rate.mean())


def _least_peak(p: _Problem) -> JointResult | None:
    """The fill-drain plan with the least peak: sum kept + max working, searched as the
    latency is (working bytes the limit, kept bytes summed, fill 1); objective = that
    peak less ``fixed``."""
    return joint_search(
        p.working,
        batch=p.batch,
        fill=1.0,
        eps=0.0,
        granularity=p.granularity,
        values=p.kept,
        sum_holds_max=False,
    )


def _fill_drain(p: _Problem, capacity: float) -> JointResult:
    budget = capacity - p.fixed
    rate = _per_token(p.kept, p.granularity)
    if rate is not None:  # exact: a limit per slice on the working bytes
        tokens = p.batch * (p.ce.shape[1] - 1) * p.granularity
        found = p.search(_masked(p.ce, p.working > budget - rate * tokens))
        return found if found is not None else _nothing_fits(p, capacity)
    fastest = p.search(p.ce)
    assert fastest is not None  # every slice allowed
    if p.peak(fastest) <= capacity:
        return fastest
    least = _nothing_fits(p, capacity)
    best, best_t = least, p.latency(least)
    omegas = {max(p.units(least)[2])}
    if np.nanmax(np.where(np.isfinite(p.working), p.working, np.nan)) > 0:
        slack = capacity - p.peak(least)
        omegas |= {min(omegas) + slack / 2, min(omegas) + slack}
    scale = p.latency(fastest) / max(sum(p.units(fastest)[1]), 1.0)  # seconds per byte
    kept = np.where(np.isfinite(p.kept), p.kept, 0.0)  # 0 x inf off the grid is no penalty
    for omega in sorted(omegas):
        ce = _masked(p.ce, p.working > omega)

        def at(lam: float, ce: np.ndarray = ce) -> JointResult | None:
            r = p.search(ce, values=ce + lam * kept)
            return r if r is not None and p.peak(r) <= capacity else None

        fits = [r] if (r := at(0.0)) is not None else []
        lo, hi, lam = 0.0, 0.0, scale / 16
        while not fits and lam < scale * 4.0**LAMBDA_STEPS:
            if (r := at(lam)) is not None:
                hi, fits = lam, [r]
            else:
                lo, lam = lam, lam * 4
        for _ in range(BISECTIONS if hi > 0 else 0):
            mid = (lo + hi) / 2
            if (r := at(mid)) is not None:
                hi = mid
                fits.append(r)
            else:
                lo = mid
        for r in fits:
            if (t := p.latency(r)) < best_t:
                best, best_t = r, t
        # Limits on each slice's kept bytes cut the sum too: more candidates, checked.
        kept_values = np.unique(p.kept[np.isfinite(ce)])
        for a in kept_values[np.linspace(0, len(kept_values) - 1, A_VALUES).round().astype(int)]:
            r = p.search(_masked(ce, p.kept > a), incumbent=best_t)
            if r is not None and p.peak(r) <= capacity:
                best, best_t = r, p.latency(r)
    return best


def _nothing_fits(p: _Problem, capacity: float) -> JointResult:
    """The least-peak plan if it fits; else raise :class:`NothingFitsError`."""
    least = _least_peak(p)
    assert least is not None  # every slicing has a finite peak
    peak = p.fixed + least.objective
    if peak > capacity:
        raise NothingFitsError(
            f"no plan fits in {capacity / GIB:.3f} GiB: the smallest peak any plan "
            f"attains is {peak / GIB:.3f} GiB ({p.fixed / GIB:.3f} GiB of it fixed: weights, "
            "optimizer state, reserve), with batch slices "
            f"{list(least.sizes)} cut {[len(s) for s in least.slicings]} times; add memory, "
            "recompute, or take fewer sequences per pipeline",
            peak,
        )
    return least


def _one_f_one_b(p: _Problem, capacity: float, w: int) -> JointResult:
    fastest = p.search(p.ce)
    assert fastest is not None  # every slice allowed
    if p.window_peak(fastest, w) <= capacity:
        return fastest
    budget, n = capacity - p.fixed, p.ce.shape[1] - 1
    finite = np.isfinite(p.ce)
    kept = np.unique(p.kept[finite])
    no_working = not (p.working[finite] > 0).any()
    i, j = np.indices(p.ce.shape[1:])
    best: JointResult | None = None

    def search(m: int, a: float, omega: float) -> JointResult | None:
        short = (i - j) < -(-n // m)  # every slice >= ceil(n / m) steps: M <= m
        forbid = short[None] | (p.kept > a) | (p.working > omega)
        incumbent = np.inf if best is None else best.objective
        return p.search(_masked(p.ce, forbid), incumbent=incumbent)

    best_m, tops = 0, dict[int, float]()
    for m, a, omega in _window_candidates(n, w, kept, budget, no_working):
        tops[m] = max(tops.get(m, 0.0), a)
        if (found := search(m, a, omega)) is not None:
            best, best_m = found, m
    # Beyond the sufficient limits, near the best m (every m if none): plans count if
    # their peak fits. Per m, a bisection over the kept bytes' values up to the budget.
    for m in [m for m in tops if best is None or best_m / 2 <= m <= 2 * best_m]:
        above = kept[(kept > tops[m]) & (kept <= budget)]
        if len(above) > 2 * A_VALUES:
            above = above[np.linspace(0, len(above) - 1, 2 * A_VALUES).round().astype(int)]
        lo, hi = -1, len(above)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            found = search(m, float(above[mid]), budget - float(above[mid]))
            if found is not None and p.window_peak(found, w) > capacity:
                hi = mid
            else:
                best, lo = found or best, mid
    if best is not None:
        return best
    raise _window_error(p, capacity, w)


def _window_candidates(
    n: int, w: int, kept: np.ndarray, budget: float, no_working: bool
) -> list[tuple[int, float, float]]:
    """(m, a, omega): M <= m token slices, kept bytes <= a and working bytes <= omega
    per slice, (w + m) a + omega within the budget: sufficient. Every m up to
    :data:`MAX_CANDIDATES` steps, then powers of two; a from the kept bytes' own values
    (a limit between two of them forbids what the lower one does), all of them or
    :data:`A_VALUES` quantiles."""
    if budget < 0:
        return []
    if kept.max() == 0:  # no kept bytes to bound: the working bytes' limit is exact
        return [(n, 0.0, budget)]
    ms = (
        range(1, n + 1)
        if n <= MAX_CANDIDATES
        else [min(2**e, n) for e in range(n.bit_length() + 1)]
    )
    # A grid of ceil(n / m) steps allows floor(n / ceil(n / m)) slices: the tightest m.
    tight = sorted({n // -(-n // m) for m in ms}, reverse=True)
    out = []
    for m in tight:
        top = budget / (w + m)
        if no_working:
            out.append((m, top, 0.0))
            continue
        below = kept[kept <= top]
        if len(below) > A_VALUES:
            below = below[np.linspace(0, len(below) - 1, A_VALUES).round().astype(int)]
        out += [(m, float(a), budget - (w + m) * float(a)) for a in below[::-1]]
    return out


def _window_error(p: _Problem, capacity: float, w: int) -> NothingFitsError:
    """The 1F1B planner found nothing: a lower bound on any plan's peak. Every plan
    holds some batch slice's units at once (at least its least kept sum) and each unit
    with its own working bytes."""
    bmax = p.ce.shape[0] - 1
    bs = np.arange(1, bmax + 1)
    S, _, _ = run_dp(p.kept, bs, np.full(bmax, np.inf))
    both = bottleneck(p.kept + p.working, bs)
    lower = p.fixed + max(float(S.min()), float(both.min()))
    return NothingFitsError(
        f"no plan the planner can vouch for fits in {capacity / GIB:.3f} GiB under 1F1B "
        f"(w={w}): any plan's peak is at least {lower / GIB:.3f} GiB ({p.fixed / GIB:.3f} GiB "
        "fixed); plans near that bound may exist that the planner's sufficient per-slice "
        "limits miss; add memory or recompute",
        lower,
    )


def fitting_joint(
    cost: SliceCostModel,
    memory: SliceMemory,
    capacity: float,
    *,
    seq_len: int,
    batch: int,
    n_stages: int,
    granularity: int = 8,
    eps: float = 0.0,
    max_batch_slice_size: int | None = None,
    per_batch_slice: Callable[[int], float] | None = None,
    n_chunks: int = 1,
) -> Plan:
    """The fastest plan (fill-drain latency, as :func:`~tplib.planner.joint.exact_joint`)
    whose peak under ``memory`` fits ``capacity`` bytes: exact or only feasible, as the
    module docstring says case by case. Raises
    :class:`~tplib.planner.memory.NothingFitsError` when no plan fits."""
    if isinstance(capacity, bool) or not isinstance(capacity, int | float) or not capacity > 0:
        raise ValueError(f"capacity={capacity!r}: must be a positive number of bytes")
    w = check_rule(memory)
    fill = fill_factor(n_stages, n_chunks)
    ce, bmax = prepare(cost, seq_len, batch, n_stages, granularity, eps, max_batch_slice_size)
    kept, working = memory_grids(
        memory, seq_len=seq_len, max_batch_slice_size=bmax, granularity=granularity
    )
    extra = np.array(
        [0.0 if per_batch_slice is None else per_batch_slice(b) for b in range(1, bmax + 1)]
    )
    p = _Problem(
        ce, by_end(kept), by_end(working), batch, fill, eps, granularity, extra, float(memory.fixed)
    )
    del kept, working
    found = _fill_drain(p, capacity) if w is None else _one_f_one_b(p, capacity, w)
    plan = Plan(found.sizes, found.slicings, p.latency(found), max(p.units(found)[0]), eps)
    peak = peak_bytes(plan, memory)
    if peak > capacity * (1 + 1e-12):
        raise AssertionError(f"planned peak {peak} exceeds capacity {capacity}: a planner bug")
    return plan
