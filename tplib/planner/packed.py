"""Plans for a packed batch: token slices and a batch split for rows of several documents.

The rows of a packed batch differ (:mod:`tplib.documents`): each holds its own documents,
and a slice's attention work depends on where they begin (:mod:`tplib.planner.packed_cost`).
So rows are no longer interchangeable, and a batch slice is a *contiguous* group of rows
(a :class:`~tplib.plan.Plan`'s batch slices are groups of consecutive sequences).

:func:`plan_packed` minimises the true fill-drain latency, as
:func:`~tplib.planner.joint.exact_joint` does on unpacked rows: one ``t_max`` for all
units, ``sum_d S*_d + (K - 1) / v * t_max``. Per eps-window of ``t_max`` (searched by
:class:`~tplib.planner.dp.Search`'s branch and bound), :func:`~tplib.planner.dp.run_dp`
finds ``S*`` for every contiguous row range ``[r0, r1)`` of at most ``bmax`` rows, all
ranges and probed windows in one sweep; then a shortest path over row ranges
(:func:`_split`: ``f(r1) = min_r0 f(r0) + S*[r0, r1)``) picks the batch split. It is exact
over the grid with ``eps = 0``: for the optimal plan's largest slice time ``m``, the
window whose top is ``m`` allows every slice of it, so the DP and the split find a plan at
least as good.

What makes it fast enough per batch. The cost grids of all ranges come from row prefix
sums of the pairs prefix in one numpy expression. The cheap plans of
:func:`_best_uniform` give an incumbent. And the model's form bounds every window from
below before any DP (:func:`_windows`): a batch slice's times add up to ``m a_b`` plus a
part no cut changes, so only windows whose bound beats the incumbent are searched. The
grids hold ``R (L / g + 1)^2`` floats for R ranges: 64 MB for 32 rows, ``bmax`` = 4 and
L / g = 256.

:func:`snap_uniform` is the cheap alternative, with no DP: uniform token slices whose
cuts move to a nearby document boundary.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tplib.documents import Documents
from tplib.plan import Plan, grid_size
from tplib.planner.dp import Search, fill_factor, run_dp, trace, windows
from tplib.planner.packed_cost import PackedCost

__all__ = ["ROWS", "plan_packed", "snap_uniform"]

ROWS = 512  # DP rows per sweep: (row range, t_max window) pairs


def _ranges(batch: int, bmax: int) -> tuple[np.ndarray, np.ndarray]:
    """First and end rows of every contiguous range of 1..bmax rows, listed by size (so
    :meth:`PackedCost.range_grids` adds each size's part in one run)."""
    lo = np.concatenate([np.arange(batch - b + 1) for b in range(1, bmax + 1)])
    sizes = np.concatenate([np.full(batch - b + 1, b) for b in range(1, bmax + 1)])
    return lo, lo + sizes


def _split(
    S: np.ndarray, M: np.ndarray, lo: np.ndarray, hi: np.ndarray, batch: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per probe p, the contiguous batch split minimising ``sum S[p, range]``: its total,
    the largest slice time in it (from ``M``) and per end row the range chosen last."""
    p = np.arange(len(S))
    f = np.full((len(S), batch + 1), np.inf)
    f[:, 0] = 0.0
    peak = np.zeros((len(S), batch + 1))
    pick = np.zeros((len(S), batch + 1), dtype=np.int64)
    for r1 in range(1, batch + 1):
        idx = np.flatnonzero(hi == r1)
        v = f[:, lo[idx]] + S[:, idx]
        k = idx[v.argmin(axis=1)]
        f[:, r1] = S[p, k] + f[p, lo[k]]
        peak[:, r1] = np.maximum(peak[p, lo[k]], M[p, k])
        pick[:, r1] = k
    return f[:, batch], peak[:, batch], pick


def _check(cost: PackedCost, eps: float, max_batch_slice_size: int | None, batch: int) -> int:
    if not eps >= 0:
        raise ValueError(f"eps={eps}: the t_max tolerance must be >= 0 seconds (0 is exact)")
    limit, fitted = max_batch_slice_size, cost.max_batch_slice_size
    if limit is not None and not 1 <= limit <= fitted:
        raise ValueError(
            f"max_batch_slice_size={limit} is outside 1..{fitted}: a batch slice holds at "
            "least one row and at most the PackedCost's max_batch_slice_size"
        )
    return min(batch, limit or batch, fitted)


def plan_packed(
    cost: PackedCost,
    documents: Documents,
    *,
    n_stages: int,
    granularity: int = 8,
    eps: float = 0.0,
    max_batch_slice_size: int | None = None,
    n_chunks: int = 1,
) -> Plan:
    """The plan of least ``sum t + (K - 1) / v * max t`` for the packed rows ``documents``
    (v = ``n_chunks``): batch slices of at most ``max_batch_slice_size`` contiguous rows,
    token slices on the grid of ``granularity`` tokens, within ``(K - 1) / v * eps`` of
    the optimum (exact with eps = 0). ``Plan.latency`` is that objective."""
    fill = fill_factor(n_stages, n_chunks)
    n = grid_size(documents.seq_len, granularity)
    B = documents.batch
    bmax = _check(cost, eps, max_batch_slice_size, B)
    lo, hi = _ranges(B, bmax)
    sizes, R = hi - lo, len(lo)
    # Row prefix sums of the pairs prefix on the grid: every range's mean in one step.
    C = np.zeros((B + 1, n + 1))
    C[1:] = np.cumsum(documents.pairs_prefix()[:, ::granularity], axis=0)
    Q = (C[hi] - C[lo]) / sizes[:, None]
    ce = cost.range_grids(sizes, Q, granularity)
    best = _best_uniform(ce, lo, sizes, B, bmax, fill, granularity)
    if fill == 0:  # no fill term: the fewest slices, which no t_max limits
        starts = tops = np.array([np.inf])
    else:
        pairs = Q[:, n] - Q[:, 0]
        starts, tops = _windows(
            ce, cost, sizes, pairs, documents.seq_len, lo, hi, B, fill, best[2], eps
        )
    search = Search(starts, tops, fill, incumbent=best[2])
    while len(p := search.probes(max(1, ROWS // R))):
        rows_b, rows_t = np.tile(np.arange(R), len(p)), np.repeat(search.tops[p], R)
        S, M, back = run_dp(ce, rows_b, rows_t)
        total, peak, pick = _split(S.reshape(len(p), R), M.reshape(len(p), R), lo, hi, B)
        k = search.report(p, total, total + fill * peak, peak)
        if k >= 0:
            chosen = _chosen(pick[k], lo, B)
            best = (
                tuple(int(sizes[r]) for r in chosen),
                tuple(trace(back[k * R + r], granularity) for r in chosen),
                float(total[k] + fill * peak[k]),
                float(peak[k]),
            )
    return Plan(best[0], best[1], best[2], best[3], eps)


def _chosen(pick: np.ndarray, lo: np.ndarray, batch: int) -> list[int]:
    """The ranges of a split, first row first, from :func:`_split`'s choices."""
    out, r1 = [], batch
    while r1 > 0:
        out.append(int(pick[r1]))
        r1 = int(lo[out[-1]])
    return out[::-1]


def _windows(
    ce: np.ndarray,
    cost: PackedCost,
    sizes: np.ndarray,
    pairs: np.ndarray,
    seq_len: int,
    lo: np.ndarray,
    hi: np.ndarray,
    batch: int,
    fill: float,
    best: float,
    eps: float,
) -> tuple[np.ndarray, np.ndarray]:
    """The t_max windows (starts, tops) that may hold a plan better than ``best``.

    With eps = 0, every distinct slice time (exact); else windows of eps from the
    cheapest slice up, ``[v + k eps, v + (k + 1) eps]``: any plan's largest slice lies in
    one, whose DP allows all its slices and finds a plan within eps of its t_max (the
    guarantee of :func:`~tplib.planner.dp.windows`, without sorting millions of times).

    Windows are dropped by a lower bound from the model's form. Below its pair-free curve
    lies a line ``a_b + alpha_b l`` (:meth:`PackedCost.bound`), so each slice costs at
    least ``a_b`` plus its share of ``c = alpha_b L + gamma_b pairs`` (``pairs``: the
    range's mean pairs over the whole row), and a batch slice's m slices at least
    ``m a_b + c``, whatever the cuts; m slices of at most t need ``m >= c / (t - a_b)``.
    So a window [s, t] holds no plan below
    ``split of sum (a_b ceil(c / (t - a_b)) + c) + fill * s``."""
    n, R = ce.shape[1] - 1, len(sizes)
    a, alpha, gamma = cost.bound(sizes)
    c = alpha * seq_len + gamma * pairs
    s_inf = c + np.where(a >= 0, a, n * a)  # S* with no limit
    # A better plan has t_max <= cut: s_inf + fill * t_max <= S* + fill * t_max < best.
    # (The slack keeps float rounding from cutting the optimum off.)
    slack = 1e-9 * abs(best)
    cut = (best + slack - float(_split(s_inf[None], np.zeros((1, R)), lo, hi, batch)[0][0])) / fill
    if eps == 0:
        starts, tops = windows(np.unique(ce[ce <= cut]), 0.0)
    else:
        v = float(ce.min())
        starts = v + eps * np.arange(max(0, int(np.ceil((cut - v) / eps))))
        tops = starts + eps
    if (alpha < 0).any() or (gamma < 0).any():
        return starts, tops  # a slice may then cost a_b or less: no bound from the count
    with np.errstate(divide="ignore", invalid="ignore"):
        # (1 - 1e-9): a count that is a whole number must not round up past it.
        m = np.ceil(c / (tops[:, None] - a) * (1 - 1e-9))
    # With c > 0 every slice costs more than a_b; with c = 0 one slice does.
    m = np.where(c > 0, np.where(tops[:, None] > a, m, np.inf), 1.0)
    S = np.where(np.isinf(m), np.inf, c + np.where(a >= 0, a * m, n * a))
    bound = _split(S, np.zeros_like(S), lo, hi, batch)[0] + fill * starts
    keep = bound < best + slack
    return starts[keep], tops[keep]


def _best_uniform(
    ce: np.ndarray,
    lo: np.ndarray,
    sizes: np.ndarray,
    batch: int,
    bmax: int,
    fill: float,
    granularity: int,
) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...], float, float]:
    """The best of the cheap plans the search must beat: batch slices of b rows (the
    last of what is left), each cut into m equal slices on the grid, for every b and m
    in a geometric ladder; (sizes, slicings, objective, t_max)."""
    n = ce.shape[1] - 1
    first = {int(b): int(np.flatnonzero(sizes == b)[0]) for b in np.unique(sizes)}
    best: tuple[tuple[int, ...], tuple[tuple[int, ...], ...], float, float] = ((), (), np.inf, 0.0)
    for b in range(1, bmax + 1):
        starts = np.arange(0, batch, b)
        group = np.minimum(b, batch - starts)
        ids = np.array([first[int(g)] + int(s) for s, g in zip(starts, group, strict=True)])
        for m in np.unique(np.round(1.25 ** np.arange(40)).astype(int)):
            if m > n:
                break
            cuts = (np.arange(m + 1) * n) // m
            t = ce[ids[:, None], cuts[None, 1:], cuts[None, :-1]]
            objective = float(t.sum() + fill * t.max())
            if objective < best[2]:
                slicing = tuple(int(x) * granularity for x in np.diff(cuts))
                best = (
                    tuple(int(g) for g in group),
                    (slicing,) * len(ids),
                    objective,
                    float(t.max()),
                )
    return best


def _batch_split(batch_slices: int | Sequence[int], batch: int) -> tuple[int, ...]:
    if isinstance(batch_slices, int):
        if batch_slices < 1:
            raise ValueError(f"batch_slices={batch_slices}: a batch slice holds >= 1 row")
        return tuple(min(batch_slices, batch - r) for r in range(0, batch, batch_slices))
    sizes = tuple(int(b) for b in batch_slices)
    if not sizes or min(sizes) < 1 or sum(sizes) != batch:
        raise ValueError(
            f"batch_slices={list(sizes)}: contiguous batch slices of >= 1 row each must "
            f"cover the batch of {batch} rows exactly"
        )
    return sizes


def snap_uniform(
    documents: Documents,
    n_slices: int,
    *,
    granularity: int = 8,
    window: int | None = None,
    batch_slices: int | Sequence[int] = 1,
) -> Plan:
    """Uniform token slices whose cuts move to nearby document boundaries (no DP).

    The rule, per batch slice (contiguous rows: ``batch_slices`` gives their sizes, or
    one size for all, the last holding what is left): start from ``n_slices`` slices as
    equal as the grid of ``granularity`` tokens allows (longer first, as
    :meth:`Plan.uniform`). The candidates are the document boundaries of the batch slice's
    rows, each rounded to the nearest grid point, 0 and ``L`` left out. From first to
    last, each inner cut moves to the nearest candidate at most ``window`` tokens away
    (default: half a slice; on a tie, the earlier) that lies past the cut before it; with
    none, it stays, unless that too is not past the cut before (then it is dropped). So a
    slice tends to begin a document, whose queries then see no context of it; the slice
    count never grows and ``window=0`` keeps the uniform plan. The rule does not look at
    costs, so any gain over uniform slices is whatever the documents happen to give:
    compare with :func:`plan_packed` on :func:`~tplib.planner.packed_cost.packed_latency`.
    """
    L, g = documents.seq_len, granularity
    n = grid_size(L, g)
    if not 1 <= n_slices <= n:
        raise ValueError(
            f"n_slices={n_slices} is outside 1..{n}: slices on a grid of {g} tokens over {L} tokens"
        )
    w = L / n_slices / 2 if window is None else window
    if not w >= 0:
        raise ValueError(f"window={window}: a cut moves at most window >= 0 tokens")
    sizes = _batch_split(batch_slices, documents.batch)
    q, r = divmod(n, n_slices)
    uniform = g * np.cumsum([q + 1 if i < r else q for i in range(n_slices)])[:-1]
    rounded = documents.rounded_boundaries(g)
    slicings, first = [], 0
    for size in sizes:
        grid = set().union(*rounded[first : first + size])
        first += size
        candidates = np.array(sorted(grid), dtype=np.int64)
        cuts = [0]
        for u in uniform.tolist():
            near = candidates[(np.abs(candidates - u) <= w) & (candidates > cuts[-1])]
            if len(near):
                cuts.append(int(near[np.argmin(np.abs(near - u))]))
            elif u > cuts[-1]:
                cuts.append(u)
        slicings.append(tuple(np.diff([*cuts, L]).tolist()))
    return Plan(sizes, tuple(slicings))
