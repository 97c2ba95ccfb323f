"""The token DP (paper §3.3, Algorithm 1): the best slicing of one batch slice.

A cost model gives the per-stage time ``t(l, c)`` of a slice of ``l`` tokens after ``c``
tokens of context (Eq. 4). With ``K`` stages, a slicing ``l_1..l_M`` of a sequence costs

    T = sum_i t_i + (K - 1) * max_i t_i                                         (Eq. 5)

With virtual stages, ``v`` chunks per stage (``n_chunks``; the schedules
``terapipe-interleaved`` and ``terapipe-bfs``), each stage holds v parts of the model and a
slice costs each part t_i / v, t_i still a whole stage's time (all its chunks, each with
its messages). The planner then minimises

    T_v = sum_i t_i + (K - 1) / v * max_i t_i                                  (Eq. 5, v)

the same DP with the fill term's weight (K - 1) / v (:func:`fill_factor`). What T_v is
for each schedule, with identical stages, free communication and a forward that takes a
fixed share of each t_i (the simulator's :func:`~tplib.sim.simulate.costs_from_slice_model`):

- ``terapipe-bfs`` (every unit through chunk 0, then chunk 1, ...; backwards in reverse):
  T_v is its latency exactly when ``sum_i t_i >= K * max_i t_i``. Each chunk's round is a
  flow shop on K ranks whose longest path fills the pipe once, by K - 1 parts of 1/v of
  a stage on the largest unit, and passes each later round's rank through the stage's
  queue (the whole round, sum t / v) rather than round the ring (K t_j / v), which the
  condition makes the longer way. With fewer or smaller units the ring idles between
  rounds and T_v is a lower bound.
- ``terapipe-interleaved`` (Megatron's 1F1B over groups of K units): T_v is its latency
  on equal units in full groups (each sequence cut into K token slices, or one sequence
  into a multiple of K), Megatron's (units + (K - 1) / v) t. On every other slicing the
  tests enumerate it stays below the simulated latency, by up to 2x where sequences have
  more token slices than K: the generator's warm-up, counted from (v - 1) K + M - 1,
  then falls short of the first backward's place in the forward order, and the stages
  wait on each other in turn. T_v is a lower bound there, not a prediction.

Fixing ``t_max`` turns this into the DP ``S*(i) = min_k S*(i - k) + t(k, i - k)`` over
slices with ``t <= t_max`` (Eq. 8, Algorithm 1), and ``T* = min over t_max of
S*(L) + (K - 1) t_max`` (Eq. 6). Lengths live on a grid of ``g`` tokens (``n = L / g``).
:func:`run_dp` solves Eq. 8 for many (batch-slice size, t_max) rows in one vectorised
sweep; the joint planners of :mod:`tplib.planner.joint` reuse it.

How ``t_max`` is searched. Candidates are the sorted distinct slice costs, grouped into
*eps-windows* from the smallest up: a window starts at the smallest value not yet covered
and holds the values below start + eps. The DP runs with ``t_max`` = the window's top, so
every slicing whose largest slice falls in the window is allowed and the result is within
``(K - 1) / v * eps`` of the optimum (eps=0: one window per value, exact). (Trying the
window's *first* value, as a literal reading of the paper does, loses that bound when the
next candidate lies far above.) Windows are searched by branch and bound, many at once in
one DP sweep. The first sweep tries a ladder of limits, 2**-4 .. 2**-10 of the span above
the lowest window: the fill term favours small t_max, and small limits keep the sweep's
band of slices narrow. Then ``S*`` never increasing with ``t_max`` bounds the windows
between two evaluated ones a < c by ``S*(c) + (K - 1) * start`` and ``K * start`` (the
paper's stop rule); a plan found at c rules out the windows from its largest slice up to
c (each plan there sums at least S*(c)); and a gap whose bound reaches the best T found is
dropped. The answer is the best T over the windows, whatever order they are tried in.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from itertools import pairwise

import numpy as np

from tplib.planner.cost_table import check_batch_slice_size, derive, end_table
from tplib.sim.costs import SliceCostModel

__all__ = [
    "Search",
    "TokenSlicing",
    "algorithm1",
    "fill_factor",
    "prepare",
    "run_dp",
    "token_dp",
    "windows",
]

PROBES = 16  # t_max windows probed per objective per DP sweep; more = fewer, wider sweeps
LADDER = (4.0, 10.0)  # the first sweep's limits: 2**-4 .. 2**-10 of the windows' span up
LADDER_PROBES = 8  # windows in that first sweep, per objective


@dataclass(frozen=True)
class TokenSlicing:
    """The token DP's answer for one batch-slice size."""

    slices: tuple[int, ...]  # token lengths l_1..l_M
    latency: float  # T = total + (K - 1) / v * t_max (Eq. 5; v = 1 without chunks)
    t_max: float  # largest slice time of this slicing (may be below the t_max tried)
    total: float  # sum of the slice times, S*(L; t_max)


# ---- the DP (Algorithm 1), vectorised over many (batch-slice size, t_max) rows ---------

BLOCK = 1 << 16  # DP cells (slice x row) prepared at once: small enough to stay in cache


def _band(ce: np.ndarray, bs: np.ndarray, limit: float) -> np.ndarray:
    """``lo[i]``: the first start j of a slice ending at i with a time <= ``limit`` for some
    size in ``bs`` (``i`` if none): with costs growing in length, a narrow band of starts."""
    n = ce.shape[1] - 1
    fits = ce[bs[0]] <= limit
    for b in bs[1:]:
        fits |= ce[b] <= limit
    return np.where(fits.any(axis=1), fits.argmax(axis=1), np.arange(n + 1))


def _blocks(lo: np.ndarray, rows: int) -> Iterator[tuple[int, int, np.ndarray, np.ndarray]]:
    """The band's cells (end i, start j >= lo[i]) in blocks of about BLOCK cells x rows:
    (first end, end past the last, the block's i, its j), i ascending, then j."""
    n, width = len(lo) - 1, np.arange(len(lo)) - lo
    off, i = np.concatenate(([0], np.cumsum(width))), 1
    while i <= n:
        e = min(n + 1, max(i + 1, int(np.searchsorted(off, off[i] + BLOCK // rows, "right")) - 1))
        ends = np.repeat(np.arange(i, e), width[i:e])
        yield i, e, ends, np.arange(off[i], off[e]) - np.repeat(off[i:e] - lo[i:e], width[i:e])
        i = e


def run_dp(
    ce: np.ndarray, rows_b: np.ndarray, rows_t: np.ndarray, values: np.ndarray | None = None
) -> tuple[np.ndarray, ...]:
    """Eq. 8 for every row r (batch-slice size rows_b[r], limit rows_t[r]) at once.
    Returns S*(n) (inf if no slicing fits), the max slice time of the chosen slicing, and
    back-pointers (start of the last slice ending at each i); the last two only mean
    something where S*(n) is finite. With ``values`` (a grid shaped as ``ce``) the DP
    sums those instead of the times, still bounding each slice's time by the row's limit:
    the memory-aware planner's penalised or memory sums. Ties go to the earliest start."""
    n, r = ce.shape[1] - 1, len(rows_t)
    bs, col = np.unique(rows_b, return_inverse=True)
    lo = _band(ce, bs, float(rows_t.max()))
    S = np.full((n + 1, r), np.inf)  # S[i, r]: positions down, rows across
    S[0], none, rows = 0.0, np.zeros(r, dtype=np.intp), np.arange(r)
    K, buf, add = [none], np.empty((n + 1, r)), np.add  # K[i]: back-pointer minus lo[i]
    limited = values is not None or bool(np.isfinite(rows_t).any())
    for i, e, ends, starts in _blocks(lo, r):
        c = ce[bs[:, None], ends, starts].T.take(col, axis=1)
        if limited:
            over = c > rows_t
            if values is not None:
                c = values[bs[:, None], ends, starts].T.take(col, axis=1)
            np.putmask(c, over, np.inf)
        o = 0
        # The sequential heart of Algorithm 1: one add and one argmin per end position,
        # every row at once; a slice over the limit costs inf.
        for q, a in zip(range(i, e), lo[i:e].tolist(), strict=True):
            if q == a:
                K.append(none)
                continue
            x = add(S[a:q], c[o : o + q - a], out=buf[: q - a])
            k = x.argmin(axis=0)
            S[q] = x[k, rows]
            K.append(k)
            o += q - a
    back = lo[:, None] + np.array(K)
    back[lo == np.arange(n + 1)] = 0  # no slice ends here (and position 0): a root
    # The largest slice on each row's path, by pointer doubling over flat (position, row)
    # indices: after round m, M[i] covers the last 2**m slices before i, ptr[i] their start.
    M = ce[rows_b, np.arange(n + 1)[:, None], back].ravel()
    M[:r] = 0.0
    ptr = (back * r + rows).ravel()
    while (ptr[n * r :] >= r).any():
        M = np.maximum(M, M.take(ptr))
        ptr = ptr.take(ptr)
    return S[n], np.where(np.isfinite(S[n]), M[n * r :], 0.0), back.T


def trace(back: np.ndarray, granularity: int) -> tuple[int, ...]:
    """The token lengths of the slicing that ``back`` points out, first to last."""
    out, i = [], len(back) - 1
    while i > 0:
        out.append((i - int(back[i])) * granularity)
        i = int(back[i])
    return tuple(reversed(out))


def bottleneck(ce: np.ndarray, bs: np.ndarray) -> np.ndarray:
    """Smallest feasible t_max per batch-slice size (min over slicings of the max slice);
    windows below it are skipped, as Algorithm 1 finds no slicing there."""
    n, nb = ce.shape[1] - 1, len(bs)
    # Slicing into single grid steps bounds every size's answer from above, so slices
    # dearer than its largest step lie on no min-max path: the band leaves them out.
    upper = ce[bs[:, None], np.arange(1, n + 1), np.arange(n)].max()
    lo = _band(ce, bs, float(upper))
    B = np.full((n + 1, nb), np.inf)
    B[0] = 0.0
    buf = np.empty((n + 1, nb))
    for i, e, ends, starts in _blocks(lo, nb):
        c, o = ce[bs[:, None], ends, starts].T, 0
        for q, a in zip(range(i, e), lo[i:e].tolist(), strict=True):
            if q > a:
                x = np.maximum(B[a:q], c[o : o + q - a], out=buf[: q - a])
                np.minimum.reduce(x, axis=0, out=B[q])
                o += q - a
    return B[n]


# ---- the t_max search ----------------------------------------------------------------


def windows(times: np.ndarray, eps: float) -> tuple[np.ndarray, np.ndarray]:
    """Starts and tops of the eps-windows over the distinct finite values of ``times``."""
    values = np.unique(times[np.isfinite(times)])
    if eps <= 0 or len(values) < 2 or np.diff(values).min() >= eps:
        return values, values
    # Each window's successor starts at the first value >= start + eps: follow that chain
    # by bisecting a list (a numpy call per window would dominate planning time).
    v, first, i = values.tolist(), [0], 0
    while (i := bisect_left(v, v[i] + eps, i + 1)) < len(v):
        first.append(i)
    idx = np.asarray(first)
    return values[idx], values[np.append(idx[1:], len(values)) - 1]


def fill_factor(n_stages: int, n_chunks: int = 1) -> float:
    """The weight of t_max in the objective: K - 1, or (K - 1) / v with v chunks per
    stage (see the module docstring)."""
    if n_stages < 1 or n_chunks < 1:
        raise ValueError(
            f"n_stages K={n_stages}, n_chunks v={n_chunks}: a pipeline needs at least one "
            "stage, and each stage at least one chunk"
        )
    return (n_stages - 1) / n_chunks


class Search:
    """Branch and bound over t_max windows for one objective (module docstring):
    T = S* + ``fill`` * t_max. ``gaps``: (a, e, c), windows a+1..e-1 still open, where S*
    is at least S[c] (c >= e tried, or the sentinel S[W] = 0: sums are non-negative).
    ``best`` starts at ``incumbent``: only windows that can beat it are searched.
    ``sum_holds_max``: S* is at least the largest limited value (true of times, and of
    times plus a non-negative penalty; not of a memory sum limited by other bytes), which
    lets the bound use T >= (1 + fill) * t_max."""

    def __init__(
        self,
        starts: np.ndarray,
        tops: np.ndarray,
        fill: float,
        *,
        incumbent: float = np.inf,
        sum_holds_max: bool = True,
    ) -> None:
        self.starts, self.tops, self.fill = starts, tops, fill
        self.S = np.zeros(len(starts) + 1)
        self.best = incumbent
        self.gaps: list[tuple[int, int, int]] = [(-1, len(starts), len(starts))]
        self.sum_holds_max = sum_holds_max

    def _bound(self, a: int, c: int) -> float:
        # T >= S*(c) + fill * lo, and T >= (1 + fill) * lo where the sum holds the max.
        lo = self.starts[a + 1]
        if not self.sum_holds_max:
            return float(self.S[c] + self.fill * lo)
        return max(self.S[c] + self.fill * lo, (1 + self.fill) * lo)

    def probes(self, m: int) -> np.ndarray:
        """Up to about ``m`` windows to evaluate next, spread over the best gaps."""
        w, none = len(self.starts), np.array([], dtype=np.int64)
        cut = w if self.fill <= 0 else int(np.searchsorted(self.starts, self.best / self.fill))
        if self.sum_holds_max:
            cut = min(cut, int(np.searchsorted(self.starts, self.best / (1 + self.fill))))
        if self.gaps == [(-1, w, w)]:  # nothing tried yet: the ladder (module docstring)
            if not cut:
                return none
            t = self.starts[0] + (self.starts[cut - 1] - self.starts[0]) * 2.0 ** -np.linspace(
                *LADDER, min(m, LADDER_PROBES)
            )
            return np.unique(np.searchsorted(self.starts, t, "right") - 1)
        gaps = [(a, min(e, cut), c) for a, e, c in self.gaps]
        self.gaps = [g for g in gaps if g[0] + 1 < g[1] and self._bound(g[0], g[2]) < self.best]
        self.gaps.sort(key=lambda g: self._bound(g[0], g[2]))
        per, out = max(1, m // max(1, len(self.gaps))), []
        for a, e, _ in self.gaps[:m]:
            size = e - a - 1
            q = min(per, size)
            out.append(a + 1 + (np.arange(q) * size) // q + (size // q) // 2)
        return np.unique(np.concatenate(out)) if out else none

    def report(self, idx: np.ndarray, S: np.ndarray, T: np.ndarray, peak: np.ndarray) -> int:
        """Record S* and T = S* + fill * peak at the probed windows (``peak``: the largest
        slice time of each one's plan); the position of a new best, else -1."""
        self.S[idx] = S
        k = int(np.argmin(T))
        found = -1
        if T[k] < self.best:
            self.best, found = float(T[k]), k
        # Below a probed window c, every plan whose largest slice lies in [peak(c), top(c)]
        # sums at least S*(c) and so costs at least T(c) >= best: its windows are done.
        done = np.searchsorted(self.starts, peak).tolist()
        at = dict(zip(idx.tolist(), done, strict=True))
        split = []
        for a, e, c in self.gaps:
            inside = idx[(idx > a) & (idx < e)].tolist()
            for x, y in pairwise([a, *inside]):
                split.append((x, min(y, max(x + 1, at[y])), y))
            split.append((inside[-1] if inside else a, e, c))
        self.gaps = [g for g in split if g[1] - g[0] > 1]
        return found


# ---- plans of one batch slice ----------------------------------------------------------


def prepare(
    cost: SliceCostModel,
    seq_len: int,
    batch: int,
    n_stages: int,
    granularity: int,
    eps: float,
    max_batch_slice_size: int | None,
) -> tuple[np.ndarray, int]:
    """Validate the inputs; the by-end cost grid and the largest allowed batch slice."""
    if n_stages < 1:
        raise ValueError(f"n_stages K={n_stages}: a pipeline needs at least one stage")
    if batch < 1:
        raise ValueError(f"batch={batch}: need at least one sequence")
    if not eps >= 0:
        raise ValueError(f"eps={eps}: the t_max tolerance must be >= 0 seconds (0 is exact)")
    profiled, limit = cost.max_batch_slice_size, max_batch_slice_size
    if limit is not None and not 1 <= limit <= (profiled or limit):
        allowed = f"1..{profiled}" if profiled is not None else "1 or more"
        raise ValueError(
            f"max_batch_slice_size={limit} is outside {allowed}: a batch slice holds at least "
            "one sequence and at most the cost model's max_batch_slice_size"
        )
    bmax = min(batch, limit or batch, profiled or batch)
    ce = end_table(cost, seq_len=seq_len, max_batch_slice_size=bmax, granularity=granularity)
    return ce, bmax


def token_search(
    ce: np.ndarray, bs: Sequence[int], fill: float, eps: float, granularity: int
) -> dict[int, TokenSlicing]:
    """The t_max search of §3.3 for each batch-slice size in ``bs``, in shared sweeps,
    minimising S* + ``fill`` * t_max (:func:`fill_factor`)."""
    searches = {}
    floors = derive(ce, ("floors", *bs), partial(bottleneck, ce, np.asarray(bs)))
    for b, floor in zip(bs, floors, strict=True):
        starts, tops = derive(ce, ("windows", b, eps), partial(windows, ce[b : b + 1], eps))
        searches[b] = Search(starts[tops >= floor], tops[tops >= floor], fill)
    found: dict[int, TokenSlicing] = {}
    while True:
        probes = {b: p for b, s in searches.items() if len(p := s.probes(PROBES))}
        if not probes:
            return found
        rows_b = np.concatenate([np.full(len(p), b) for b, p in probes.items()])
        rows_t = np.concatenate([searches[b].tops[p] for b, p in probes.items()])
        S, M, back = run_dp(ce, rows_b, rows_t)
        T, off = S + fill * M, 0
        for b, p in probes.items():
            part = slice(off, off + len(p))
            k = searches[b].report(p, S[part], T[part], M[part])
            if k >= 0:
                r = off + k
                found[b] = TokenSlicing(
                    trace(back[r], granularity), *map(float, (T[r], M[r], S[r]))
                )
            off += len(p)


def algorithm1(
    cost: SliceCostModel,
    *,
    seq_len: int,
    t_max: float,
    batch_slice_size: int = 1,
    granularity: int = 8,
) -> tuple[float, tuple[int, ...]]:
    """Algorithm 1 for one fixed t_max: ``S*(L; t_max)`` and its slicing (inf, () if none).

    A reference oracle: the paper's Algorithm 1 as the paper states it, one ``t_max`` and
    no window search, which the tests hold :func:`token_dp` and the joint planners to."""
    b = batch_slice_size
    check_batch_slice_size(cost, b)
    ce = end_table(cost, seq_len=seq_len, max_batch_slice_size=b, granularity=granularity)
    S, _, back = run_dp(ce, np.array([b]), np.array([float(t_max)]))
    return (float(S[0]), trace(back[0], granularity)) if np.isfinite(S[0]) else (np.inf, ())


def token_dp(
    cost: SliceCostModel,
    *,
    seq_len: int,
    n_stages: int,
    batch_slice_size: int = 1,
    granularity: int = 8,
    eps: float = 0.0,
    n_chunks: int = 1,
) -> TokenSlicing:
    """The best token slicing of one batch slice of ``batch_slice_size`` sequences
    (Eqs. 5-8; with ``n_chunks`` v > 1, Eq. 5 with (K - 1) / v, see the module
    docstring)."""
    b = batch_slice_size
    check_batch_slice_size(cost, b)
    ce, _ = prepare(cost, seq_len, b, n_stages, granularity, eps, b)
    return token_search(ce, [b], fill_factor(n_stages, n_chunks), eps, granularity)[b]
