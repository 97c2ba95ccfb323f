"""The DP planner: how to cut a batch into pipeline units (paper §3.3–3.4, Algorithm 1).

A cost model gives the per-stage time ``t(l, c)`` of a slice of ``l`` tokens after ``c``
tokens of context (Eq. 4). With ``K`` stages, a slicing ``l_1..l_M`` of a sequence costs

    T = sum_i t_i + (K - 1) * max_i t_i                                         (Eq. 5)

Fixing ``t_max`` turns this into the DP ``S*(i) = min_k S*(i - k) + t(k, i - k)`` over
slices with ``t <= t_max`` (Eq. 8, Algorithm 1), and ``T* = min over t_max of
S*(L) + (K - 1) t_max`` (Eq. 6). Lengths live on a grid of ``g`` tokens (``n = L / g``).

Plans: ``token_dp`` (one batch-slice size), ``paper_joint`` (§3.4: the token DP for every
batch-slice size b, then a knapsack over the batch split minimising ``sum_d T_{b_d}``),
``exact_joint`` (one ``t_max`` shared by all units, the fill term counted once, i.e. the
true fill-drain latency) and the ablation baseline ``uniform`` / ``best_uniform``.

How ``t_max`` is searched. Candidates are the sorted distinct slice costs, grouped into
*eps-windows* from the smallest up: a window starts at the smallest value not yet covered
and holds the values below start + eps. The DP runs with ``t_max`` = the window's top, so
every slicing whose largest slice falls in the window is allowed and the result is within
``(K - 1) * eps`` of the optimum (eps=0: one window per value, exact). (Trying the
window's *first* value, as a literal reading of the paper does, loses that bound when the
next candidate lies far above.) Windows are searched by branch and bound, many at once in
one vectorised DP: ``S*`` never increases with ``t_max``, so the windows between two
evaluated ones a < c cannot beat ``S*(c) + (K - 1) * start`` nor ``K * start`` (the paper's
stop rule), and a gap whose bound reaches the best T found is dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Literal, Protocol

import numpy as np

from tplib.plan import Plan

__all__ = [
    "SliceCostModel", "TableCost", "TokenSlicing", "algorithm1", "best_uniform", "cost_grid",
    "exact_joint", "paper_joint", "pipeline_latency", "plan", "token_dp", "uniform",
]  # fmt: skip

PROBES = 16  # t_max windows probed per objective per DP sweep; more = fewer, wider sweeps
ROWS = 128  # DP rows per sweep in exact_joint (one row per batch-slice size per probe)


class SliceCostModel(Protocol):
    """Per-stage slice times; may also have a ``max_batch`` attribute (largest profiled b)."""

    def slice_time(self, batch: int, length: np.ndarray, context: np.ndarray) -> np.ndarray:
        """Forward+backward seconds of ONE pipeline stage for a slice of `batch` sequences,
        `length` tokens each, attending to `context` earlier tokens (numpy broadcasting),
        including the slice's send/receive time."""
        ...


class TableCost:
    """Slice times from an explicit table: ``times[b - 1, k, j]`` is the time of a slice of
    ``b`` sequences, ``k * granularity`` tokens long, after ``j * granularity`` tokens."""

    def __init__(self, times: np.ndarray | Sequence[np.ndarray], granularity: int = 8) -> None:
        self.times = np.asarray(times, dtype=float)
        if self.times.ndim != 3 or self.times.shape[1] != self.times.shape[2]:
            raise ValueError(f"TableCost times need shape (B, n+1, n+1), not {self.times.shape}")
        self.granularity = granularity

    @property
    def max_batch(self) -> int:
        return self.times.shape[0]

    def slice_time(self, batch: int, length: np.ndarray, context: np.ndarray) -> np.ndarray:
        length, context, g = np.asarray(length), np.asarray(context), self.granularity
        if not 1 <= batch <= self.max_batch:
            raise ValueError(f"TableCost has batch sizes 1..{self.max_batch}, not {batch}")
        if np.any(length % g) or np.any(context % g) or np.any(length < g) or np.any(context < 0):
            raise ValueError(f"TableCost holds positive multiples of granularity={g} only")
        if np.any((length + context) // g >= self.times.shape[1]):
            raise ValueError(f"TableCost covers {(self.times.shape[1] - 1) * g} tokens at most")
        return self.times[batch - 1, length // g, context // g]


@dataclass(frozen=True)
class TokenSlicing:
    """The token DP's answer for one batch-slice size."""

    slices: tuple[int, ...]  # token lengths l_1..l_M
    latency: float  # T = total + (K - 1) * t_max (Eq. 5)
    t_max: float  # largest slice time of this slicing (may be below the t_max tried)
    total: float  # sum of the slice times, S*(L; t_max)


# ---- cost grid -----------------------------------------------------------------------


def _check_costs(t: np.ndarray, batch: int, length: np.ndarray, context: np.ndarray) -> None:
    bad = ~np.isfinite(t) | (t < 0)
    if bad.any():
        i = np.flatnonzero(bad.ravel())[0]
        v = t.ravel()[i]
        rule = "NaN" if np.isnan(v) else "infinite" if np.isinf(v) else "negative"
        raise ValueError(
            f"cost model gave a {rule} slice time {v} at batch={batch}, "
            f"length={np.broadcast_to(length, t.shape).ravel()[i]}, "
            f"context={np.broadcast_to(context, t.shape).ravel()[i]}: slice times must be "
            "finite and non-negative seconds (check the profile or the fit there)"
        )


def _n_units(seq_len: int, granularity: int) -> int:
    if granularity < 1 or seq_len < 1:
        raise ValueError(f"seq_len L={seq_len} and granularity g={granularity} must be >= 1")
    if seq_len % granularity:
        raise ValueError(
            f"seq_len L={seq_len} is not divisible by granularity g={granularity}: slice "
            "lengths are multiples of g, so pick a g that divides L"
        )
    return seq_len // granularity


def cost_grid(
    cost: SliceCostModel, *, seq_len: int, max_batch: int, granularity: int = 8
) -> np.ndarray:
    """``grid[b, k, j]`` = time of a slice of ``b`` sequences, ``k * g`` tokens long after
    ``j * g`` tokens of context, for ``b <= max_batch``, ``k >= 1``, ``k + j <= n``; inf
    elsewhere. The cost model is called once per batch-slice size and validated."""
    n = _n_units(seq_len, granularity)
    k, j = np.nonzero(np.add.outer(np.arange(n + 1), np.arange(n + 1)) <= n)
    k, j = k[k > 0], j[k > 0]
    grid = np.full((max_batch + 1, n + 1, n + 1), np.inf)
    for b in range(1, max_batch + 1):
        length, context = k * granularity, j * granularity
        t = np.asarray(cost.slice_time(b, length, context), dtype=float)
        t = np.broadcast_to(t, k.shape)
        _check_costs(t, b, length, context)
        grid[b, k, j] = t
    return grid


def _by_end(grid: np.ndarray) -> np.ndarray:
    """Re-index ``grid[b, k, j]`` as ``ce[b, i, j]``: the slice from grid position j to i,
    so the DP's inner min over slice starts reads one contiguous row."""
    n = grid.shape[1] - 1
    i, j = np.tril_indices(n + 1, -1)
    ce = np.full_like(grid, np.inf)
    ce[:, i, j] = grid[:, i - j, j]
    return ce


# ---- the DP (Algorithm 1), vectorised over many (batch-slice size, t_max) rows ---------


def _dp(ce: np.ndarray, rows_b: np.ndarray, rows_t: np.ndarray) -> tuple[np.ndarray, ...]:
    """Eq. 8 for every row r (batch-slice size rows_b[r], limit rows_t[r]) at once.
    Returns S*(n) (inf if no slicing fits), the max slice time of the chosen slicing, and
    back-pointers (start of the last slice ending at each i)."""
    n, r = ce.shape[1] - 1, len(rows_t)
    rows = np.arange(r)
    S = np.full((r, n + 1), np.inf)
    S[:, 0] = 0.0
    M = np.zeros((r, n + 1))
    back = np.zeros((r, n + 1), dtype=np.int64)
    # Slices no row may take are skipped: with costs growing in length, this confines each
    # end position to the few starts whose slice fits under the largest t_max of the sweep.
    fits = (ce[np.unique(rows_b)] <= rows_t.max()).any(axis=0)
    first = np.where(fits.any(axis=1), fits.argmax(axis=1), np.arange(n + 1))
    limit = rows_t[:, None]
    for i in range(1, n + 1):
        lo = first[i]
        if lo == i:
            continue
        c = ce[rows_b, i, lo:i]
        v = np.where(c <= limit, S[:, lo:i] + c, np.inf)
        k = v.argmin(axis=1)
        S[:, i] = v[rows, k]
        back[:, i] = lo + k
        M[:, i] = np.maximum(M[rows, lo + k], c[rows, k])
    return S[:, n], M[:, n], back


def _trace(back: np.ndarray, granularity: int) -> tuple[int, ...]:
    out, i = [], len(back) - 1
    while i > 0:
        out.append((i - int(back[i])) * granularity)
        i = int(back[i])
    return tuple(reversed(out))


def _bottleneck(ce: np.ndarray, bs: np.ndarray) -> np.ndarray:
    """Smallest feasible t_max per batch-slice size (min over slicings of the max slice);
    windows below it are skipped, as Algorithm 1 finds no slicing there."""
    n = ce.shape[1] - 1
    B = np.full((len(bs), n + 1), np.inf)
    B[:, 0] = 0.0
    for i in range(1, n + 1):
        B[:, i] = np.maximum(B[:, :i], ce[bs, i, :i]).min(axis=1)
    return B[:, n]


def _windows(values: np.ndarray, eps: float) -> tuple[np.ndarray, np.ndarray]:
    """Starts and tops of the eps-windows over sorted distinct ``values``."""
    if eps <= 0 or len(values) < 2 or np.diff(values).min() >= eps:
        return values, values
    # Each window's successor starts at the first value >= start + eps; follow that chain
    # in plain Python (one numpy call per window would dominate planning time).
    jump, first = np.searchsorted(values, values + eps).tolist(), [0]
    while jump[first[-1]] < len(values):
        first.append(jump[first[-1]])
    idx = np.asarray(first)
    return values[idx], values[np.append(idx[1:], len(values)) - 1]


class _Search:
    """Branch and bound over t_max windows for one objective (see the module docstring).
    ``gaps`` are open intervals (a, c) of unevaluated windows; S[W] = 0 is a sentinel."""

    def __init__(self, starts: np.ndarray, tops: np.ndarray, n_stages: int) -> None:
        self.starts, self.tops, self.k = starts, tops, n_stages
        self.S = np.zeros(len(starts) + 1)
        self.best = np.inf
        self.gaps: list[tuple[int, int]] = [(-1, len(starts))]
        self.s_inf = 0.0  # S* with no limit, a lower bound on every S*

    def _bound(self, a: int, c: int) -> float:
        lo = self.starts[a + 1]
        return max(self.S[c] + (self.k - 1) * lo, self.k * lo)

    def probes(self, m: int) -> np.ndarray:
        w = len(self.starts)
        if self.gaps == [(-1, w)]:
            return np.array([w - 1])  # the unlimited DP first: it bounds everything else
        lim = self.best - self.s_inf
        cut = np.searchsorted(self.starts, lim / (self.k - 1)) if self.k > 1 else w
        cut = min(cut, np.searchsorted(self.starts, self.best / self.k))
        self.gaps = [(a, c) for a, c in self.gaps if a + 1 < cut and self._bound(a, c) < self.best]
        self.gaps.sort(key=lambda g: self._bound(*g))
        per, out = max(1, m // max(1, len(self.gaps))), []
        for a, c in self.gaps[:m]:
            size = min(c, cut) - a - 1
            q = min(per, size)
            out.append(a + 1 + (np.arange(q) * size) // q + (size // q) // 2)
        return np.unique(np.concatenate(out)) if out else np.array([], dtype=np.int64)

    def report(self, idx: np.ndarray, S: np.ndarray, T: np.ndarray) -> int:
        """Record S* and T at the probed windows; the position of a new best, else -1."""
        self.S[idx] = S
        if self.gaps == [(-1, len(self.starts))]:
            self.s_inf = float(S[-1])
        split = []
        for a, c in self.gaps:
            inside = idx[(idx > a) & (idx < c)]
            ends = [a, *inside.tolist(), c]
            split += [(x, y) for x, y in pairwise(ends) if y - x > 1]
        self.gaps = split
        k = int(np.argmin(T))
        if T[k] < self.best:
            self.best = float(T[k])
            return k
        return -1


# ---- plans -----------------------------------------------------------------------------


def _setup(
    cost: SliceCostModel, seq_len: int, batch: int, n_stages: int, granularity: int,
    eps: float, max_batch_slice: int | None,
) -> tuple[np.ndarray, int]:  # fmt: skip
    """Validate the inputs; the by-end cost grid and the largest allowed batch slice."""
    if n_stages < 1:
        raise ValueError(f"n_stages K={n_stages}: a pipeline needs at least one stage")
    if batch < 1:
        raise ValueError(f"batch={batch}: need at least one sequence")
    if not eps >= 0:
        raise ValueError(f"eps={eps}: the t_max tolerance must be >= 0 seconds (0 is exact)")
    profiled = getattr(cost, "max_batch", None)
    if max_batch_slice is not None and not 1 <= max_batch_slice <= (profiled or max_batch_slice):
        raise ValueError(
            f"max_batch_slice={max_batch_slice} is outside 1..{profiled}: the cost model "
            "has times for batch slices of 1 up to its max_batch only"
        )
    bmax = min(batch, max_batch_slice or batch, profiled or batch)
    return _by_end(cost_grid(cost, seq_len=seq_len, max_batch=bmax, granularity=granularity)), bmax


def _check_batch_slice(cost: SliceCostModel, size: int) -> None:
    profiled = getattr(cost, "max_batch", None)
    if profiled is not None and size > profiled:
        raise ValueError(
            f"batch slice of {size} sequences exceeds the cost model's max_batch={profiled}: "
            "split the batch (e.g. plan(..., max_batch_slice=...)) or profile larger batches"
        )


def _token_search(
    ce: np.ndarray, bs: Sequence[int], n_stages: int, eps: float, granularity: int
) -> dict[int, TokenSlicing]:
    """The t_max search of §3.3 for each batch-slice size in ``bs``, in shared sweeps."""
    searches = {}
    for b, floor in zip(bs, _bottleneck(ce, np.asarray(bs)), strict=True):
        starts, tops = _windows(np.unique(ce[b][np.isfinite(ce[b])]), eps)
        searches[b] = _Search(starts[tops >= floor], tops[tops >= floor], n_stages)
    found: dict[int, TokenSlicing] = {}
    while True:
        probes = {b: p for b, s in searches.items() if len(p := s.probes(PROBES))}
        if not probes:
            return found
        rows_b = np.concatenate([np.full(len(p), b) for b, p in probes.items()])
        rows_t = np.concatenate([searches[b].tops[p] for b, p in probes.items()])
        S, M, back = _dp(ce, rows_b, rows_t)
        T = S + (n_stages - 1) * M
        off = 0
        for b, p in probes.items():
            k = searches[b].report(p, S[off : off + len(p)], T[off : off + len(p)])
            if k >= 0:
                r = off + k
                found[b] = TokenSlicing(
                    _trace(back[r], granularity), *map(float, (T[r], M[r], S[r]))
                )
            off += len(p)


def algorithm1(
    cost: SliceCostModel, *, seq_len: int, t_max: float, batch_slice: int = 1,
    granularity: int = 8,
) -> tuple[float, tuple[int, ...]]:  # fmt: skip
    """Algorithm 1 for one fixed t_max: ``S*(L; t_max)`` and its slicing (inf, () if none)."""
    _check_batch_slice(cost, batch_slice)
    grid = cost_grid(cost, seq_len=seq_len, max_batch=batch_slice, granularity=granularity)
    S, _, back = _dp(_by_end(grid), np.array([batch_slice]), np.array([float(t_max)]))
    return (float(S[0]), _trace(back[0], granularity)) if np.isfinite(S[0]) else (np.inf, ())


def token_dp(
    cost: SliceCostModel, *, seq_len: int, n_stages: int, batch_slice: int = 1,
    granularity: int = 8, eps: float = 0.0,
) -> TokenSlicing:  # fmt: skip
    """The best token slicing of one batch slice of ``batch_slice`` sequences (Eqs. 5-8)."""
    _check_batch_slice(cost, batch_slice)
    ce, _ = _setup(cost, seq_len, batch_slice, n_stages, granularity, eps, batch_slice)
    return _token_search(ce, [batch_slice], n_stages, eps, granularity)[batch_slice]


def _knapsack(V: np.ndarray, batch: int) -> tuple[np.ndarray, list[list[int]]]:
    """Per row r: the multiset of batch-slice sizes (column c is size c + 1) summing to
    ``batch`` with the least total ``V[r]``; returns the totals and sizes (largest first)."""
    rows = np.arange(len(V))
    f = np.full((len(V), batch + 1), np.inf)
    f[:, 0] = 0.0
    pick = np.zeros((len(V), batch + 1), dtype=np.int64)
    for x in range(1, batch + 1):
        h = min(x, V.shape[1])
        v = f[:, x - 1 - np.arange(h)] + V[:, :h]
        pick[:, x] = v.argmin(axis=1) + 1
        f[:, x] = v[rows, pick[:, x] - 1]
    splits = []
    for r in rows:
        x, sizes = batch, []
        while x > 0 and np.isfinite(f[r, batch]):
            sizes.append(int(pick[r, x]))
            x -= sizes[-1]
        splits.append(sorted(sizes, reverse=True))
    return f[:, batch], splits


def paper_joint(
    cost: SliceCostModel, *, seq_len: int, batch: int, n_stages: int, granularity: int = 8,
    eps: float = 0.0, max_batch_slice: int | None = None,
) -> Plan:  # fmt: skip
    """§3.4: the token DP for every batch-slice size b, then the batch split minimising
    ``sum_d T_{b_d}``; ``Plan.latency`` is that sum (fill term counted per batch slice)."""
    ce, bmax = _setup(cost, seq_len, batch, n_stages, granularity, eps, max_batch_slice)
    best = _token_search(ce, range(1, bmax + 1), n_stages, eps, granularity)
    total, splits = _knapsack(np.array([[best[b].latency for b in range(1, bmax + 1)]]), batch)
    sizes = splits[0]
    return Plan(
        tuple(sizes), tuple(best[b].slices for b in sizes), float(total[0]),
        max(best[b].t_max for b in sizes), eps,
    )  # fmt: skip


def exact_joint(
    cost: SliceCostModel, *, seq_len: int, batch: int, n_stages: int, granularity: int = 8,
    eps: float = 0.0, max_batch_slice: int | None = None,
) -> Plan:  # fmt: skip
    """One t_max for all units: per window, S*_b for every b, a knapsack over the batch
    split minimising ``sum S*_{b_d}``, plus ``(K - 1) * t_max`` once: the true latency."""
    ce, bmax = _setup(cost, seq_len, batch, n_stages, granularity, eps, max_batch_slice)
    bs = np.arange(1, bmax + 1)
    starts, tops = _windows(np.unique(ce[1:][np.isfinite(ce[1:])]), eps)
    floor = _bottleneck(ce, bs).min()
    search = _Search(starts[tops >= floor], tops[tops >= floor], n_stages)
    result = None
    while len(p := search.probes(max(1, ROWS // bmax))):
        S, M, back = _dp(ce, np.tile(bs, len(p)), np.repeat(search.tops[p], bmax))
        S, M = S.reshape(len(p), bmax), M.reshape(len(p), bmax)
        total, splits = _knapsack(S, batch)
        peak = np.array(
            [max((M[r, b - 1] for b in s), default=np.inf) for r, s in enumerate(splits)]
        )
        k = search.report(p, total, total + (n_stages - 1) * peak)
        if k >= 0:
            ts = tuple(_trace(back[k * bmax + b - 1], granularity) for b in splits[k])
            result = (splits[k], ts, float(total[k] + (n_stages - 1) * peak[k]), peak[k])
    assert result is not None  # the unlimited window always yields a plan
    return Plan(tuple(result[0]), result[1], result[2], float(result[3]), eps)


def plan(
    cost: SliceCostModel, *, seq_len: int, batch: int, n_stages: int, granularity: int = 8,
    eps: float = 0.0, method: Literal["exact", "paper"] = "exact",
    max_batch_slice: int | None = None,
) -> Plan:  # fmt: skip
    """The planner's entry point: ``exact_joint`` (default) or the paper's ``paper_joint``.
    ``Plan.latency`` is the chosen objective's prediction; batch slices never exceed
    ``max_batch_slice`` nor the cost model's ``max_batch`` (when it has one)."""
    methods = {"exact": exact_joint, "paper": paper_joint}
    if method not in methods:
        raise ValueError(f"method={method!r}: choose 'exact' or 'paper'")
    return methods[method](
        cost, seq_len=seq_len, batch=batch, n_stages=n_stages, granularity=granularity,
        eps=eps, max_batch_slice=max_batch_slice,
    )  # fmt: skip


# ---- evaluating any plan, and the uniform baseline -------------------------------------


def _latency(t: np.ndarray, n_stages: int) -> float:
    if n_stages < 1:
        raise ValueError(f"n_stages K={n_stages}: a pipeline needs at least one stage")
    return float(t.sum() + (n_stages - 1) * t.max())


def _unit_times(p: Plan, cost: SliceCostModel) -> np.ndarray:
    out = []
    for size, tokens in zip(p.batch_slices, p.token_slices, strict=True):
        _check_batch_slice(cost, size)
        length = np.asarray(tokens)
        context = np.cumsum(length) - length
        t = np.broadcast_to(np.asarray(cost.slice_time(size, length, context), float), length.shape)
        _check_costs(t, size, length, context)
        out.append(t)
    return np.concatenate(out)


def pipeline_latency(
    plan_or_slices: Plan | str | Sequence[tuple[int, Sequence[int]]],
    cost: SliceCostModel, n_stages: int,
) -> float:  # fmt: skip
    """``sum t + (K - 1) * max t`` over all units of any plan (a Plan, the paper's notation,
    or (batch size, token lengths) pairs): compares plans on the true fill-drain latency."""
    p = plan_or_slices
    if isinstance(p, str):
        p = Plan.from_paper(p)
    elif not isinstance(p, Plan):
        p = Plan(tuple(b for b, _ in p), tuple(tuple(ts) for _, ts in p))
    return _latency(_unit_times(p, cost), n_stages)


def uniform(
    cost: SliceCostModel, seq_len: int, batch: int, n_stages: int, n_slices: int,
    batch_slice_size: int = 1, granularity: int = 8,
) -> Plan:  # fmt: skip
    """The ablation baseline: ``n_slices`` token slices as equal as the grid allows
    (longer first) in every batch slice of ``batch_slice_size`` sequences."""
    n = _n_units(seq_len, granularity)
    on_grid = Plan.uniform(batch, n, batch_slice_size=batch_slice_size, n_token_slices=n_slices)
    tokens = tuple(s * granularity for s in on_grid.token_slices[0])
    p = Plan(on_grid.batch_slices, (tokens,) * on_grid.n_batch_slices)
    t = _unit_times(p, cost)
    return Plan(p.batch_slices, p.token_slices, _latency(t, n_stages), float(t.max()))


def best_uniform(
    cost: SliceCostModel, seq_len: int, batch: int, n_stages: int, batch_slice_size: int = 1,
    granularity: int = 8,
) -> Plan:  # fmt: skip
    """The best of ``uniform`` over #slices = 1, 2, 4, ... (at most L / g)."""
    n = _n_units(seq_len, granularity)
    plans = [
        uniform(cost, seq_len, batch, n_stages, 2**e, batch_slice_size, granularity)
        for e in range(n.bit_length())  # 2**e <= n
    ]
    return min(plans, key=lambda p: p.latency if p.latency is not None else np.inf)
