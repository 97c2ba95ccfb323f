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
one vectorised DP: ``S*`` never increases with ``t_max``, so the windows between two
evaluated ones a < c cannot beat ``S*(c) + (K - 1) * start`` nor ``K * start`` (the paper's
stop rule), and a gap whose bound reaches the best T found is dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

import numpy as np

from tplib.planner.cost_table import by_end, check_batch_slice_size, slice_time_table
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


@dataclass(frozen=True)
class TokenSlicing:
    """The token DP's answer for one batch-slice size."""

    slices: tuple[int, ...]  # token lengths l_1..l_M
    latency: float  # T = total + (K - 1) / v * t_max (Eq. 5; v = 1 without chunks)
    t_max: float  # largest slice time of this slicing (may be below the t_max tried)
    total: float  # sum of the slice times, S*(L; t_max)


# ---- the DP (Algorithm 1), vectorised over many (batch-slice size, t_max) rows ---------


def run_dp(
    ce: np.ndarray, rows_b: np.ndarray, rows_t: np.ndarray, values: np.ndarray | None = None
) -> tuple[np.ndarray, ...]:
    """Eq. 8 for every row r (batch-slice size rows_b[r], limit rows_t[r]) at once.
    Returns S*(n) (inf if no slicing fits), the max slice time of the chosen slicing, and
    back-pointers (start of the last slice ending at each i). With ``values`` (a grid
    shaped as ``ce``) the DP sums those instead of the times, still bounding each slice's
    time by the row's limit: the memory-aware planner's penalised or memory sums."""
    values = ce if values is None else values
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
        v = np.where(
            c <= limit, S[:, lo:i] + (c if values is ce else values[rows_b, i, lo:i]), np.inf
        )
        k = v.argmin(axis=1)
        S[:, i] = v[rows, k]
        back[:, i] = lo + k
        M[:, i] = np.maximum(M[rows, lo + k], c[rows, k])
    return S[:, n], M[:, n], back


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
    n = ce.shape[1] - 1
    B = np.full((len(bs), n + 1), np.inf)
    B[:, 0] = 0.0
    for i in range(1, n + 1):
        B[:, i] = np.maximum(B[:, :i], ce[bs, i, :i]).min(axis=1)
    return B[:, n]


# ---- the t_max search ----------------------------------------------------------------


def windows(values: np.ndarray, eps: float) -> tuple[np.ndarray, np.ndarray]:
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
    """Branch and bound over t_max windows for one objective (see the module docstring):
    T = S* + ``fill`` * t_max. ``gaps`` are open intervals (a, c) of unevaluated
    windows; S[W] = 0 is a sentinel. ``best`` starts at ``incumbent``: only windows that
    can beat it are searched. ``sum_holds_max``: S* is at least the largest limited value
    (true of times, and of times plus a non-negative penalty; not of a memory sum limited
    by other bytes), which lets the bound use T >= (1 + fill) * t_max."""

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
        self.gaps: list[tuple[int, int]] = [(-1, len(starts))]
        self.s_inf = 0.0  # S* with no limit, a lower bound on every S*
        self.sum_holds_max = sum_holds_max

    def _bound(self, a: int, c: int) -> float:
        # T >= S*(c) + fill * lo, and T >= (1 + fill) * lo where the sum holds the max.
        lo = self.starts[a + 1]
        if not self.sum_holds_max:
            return float(self.S[c] + self.fill * lo)
        return max(self.S[c] + self.fill * lo, (1 + self.fill) * lo)

    def probes(self, m: int) -> np.ndarray:
        """Up to about ``m`` windows to evaluate next, spread over the best gaps."""
        w = len(self.starts)
        if self.gaps == [(-1, w)]:
            return np.array([w - 1]) if w else np.array([], dtype=np.int64)
        if not np.isfinite(self.s_inf):  # not even the unlimited DP found a slicing
            return np.array([], dtype=np.int64)
        lim = self.best - self.s_inf
        cut = np.searchsorted(self.starts, lim / self.fill) if self.fill > 0 else w
        if self.sum_holds_max:
            cut = min(cut, np.searchsorted(self.starts, self.best / (1 + self.fill)))
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
    grid = slice_time_table(
        cost, seq_len=seq_len, max_batch_slice_size=bmax, granularity=granularity
    )
    return by_end(grid), bmax


def token_search(
    ce: np.ndarray, bs: Sequence[int], fill: float, eps: float, granularity: int
) -> dict[int, TokenSlicing]:
    """The t_max search of §3.3 for each batch-slice size in ``bs``, in shared sweeps,
    minimising S* + ``fill`` * t_max (:func:`fill_factor`)."""
    searches = {}
    for b, floor in zip(bs, bottleneck(ce, np.asarray(bs)), strict=True):
        starts, tops = windows(np.unique(ce[b][np.isfinite(ce[b])]), eps)
        searches[b] = Search(starts[tops >= floor], tops[tops >= floor], fill)
    found: dict[int, TokenSlicing] = {}
    while True:
        probes = {b: p for b, s in searches.items() if len(p := s.probes(PROBES))}
        if not probes:
            return found
        rows_b = np.concatenate([np.full(len(p), b) for b, p in probes.items()])
        rows_t = np.concatenate([searches[b].tops[p] for b, p in probes.items()])
        S, M, back = run_dp(ce, rows_b, rows_t)
        T = S + fill * M
        off = 0
        for b, p in probes.items():
            k = searches[b].report(p, S[off : off + len(p)], T[off : off + len(p)])
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
    grid = slice_time_table(cost, seq_len=seq_len, max_batch_slice_size=b, granularity=granularity)
    S, _, back = run_dp(by_end(grid), np.array([b]), np.array([float(t_max)]))
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
