"""The joint search on a cost grid: one ``t_max`` for all units, a knapsack over the
batch split (paper §3.4 made exact).

:func:`joint_search` is the engine of :func:`~tplib.planner.joint.exact_joint` and of the
memory-aware planner (:mod:`tplib.planner.memory_joint`). Per eps-window of ``t_max`` it
runs the token DP (:func:`~tplib.planner.dp.run_dp`) for every batch-slice size b at
once, then :func:`knapsack` picks the batch split minimising ``sum_d S*_{b_d}``, and the
objective adds ``fill * t_max`` once; the windows are searched by
:class:`~tplib.planner.dp.Search`'s branch and bound.

It reads a grid the caller may have edited: a slice a memory limit forbids is an
infinite cell, which no slicing takes (so the search is exact over the slicings left).
It may also sum a second grid (``values``) while ``t_max`` still bounds the first: times
plus a penalty on memory, or a memory sum bounded by working bytes. It returns None
when no plan is left, or none beats ``incumbent``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tplib.planner.cost_table import derive
from tplib.planner.dp import PROBES, Search, bottleneck, run_dp, trace, windows

__all__ = ["ROWS", "JointResult", "joint_search", "knapsack"]

ROWS = 128  # DP rows per sweep at most (a row per batch-slice size per probe)


@dataclass(frozen=True)
class JointResult:
    """A plan found by :func:`joint_search`: batch-slice sizes (largest first), their
    token slicings, the objective ``sum S + fill * t_max`` and that ``t_max``."""

    sizes: tuple[int, ...]
    slicings: tuple[tuple[int, ...], ...]
    objective: float
    t_max: float


def knapsack(V: np.ndarray, batch: int) -> tuple[np.ndarray, list[list[int]]]:
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


def joint_search(
    ce: np.ndarray,
    *,
    batch: int,
    fill: float,
    eps: float,
    granularity: int,
    extra: np.ndarray | None = None,
    values: np.ndarray | None = None,
    incumbent: float = np.inf,
    sum_holds_max: bool = True,
) -> JointResult | None:
    """The best plan on the by-end grid ``ce[b, i, j]`` (b = 1..bmax): minimise
    ``sum_d (S_{b_d} + extra[b_d - 1]) + fill * t_max`` over batch splits and t_max
    windows, S summing ``values`` (default: ``ce`` itself) over slices whose ``ce`` is at
    most t_max. None if no slicing is left or nothing beats ``incumbent``.
    ``sum_holds_max``: see :class:`~tplib.planner.dp.Search`."""
    bmax = ce.shape[0] - 1
    bs = np.arange(1, bmax + 1)
    extra = np.zeros(bmax) if extra is None else extra
    if not np.isfinite(ce[1:]).any():
        return None
    floor = derive(ce, ("floors", *bs), lambda: bottleneck(ce, bs)).min()
    if not np.isfinite(floor):
        return None
    if np.isfinite(incumbent):  # the unlimited DP's bound, before sorting every cell
        S, _, _ = run_dp(ce, bs, np.full(bmax, np.inf), values)
        total, _ = knapsack((S + extra)[None], batch)
        if total[0] + fill * floor >= incumbent:
            return None
    starts, tops = derive(ce, ("windows 1..", bmax, eps), lambda: windows(ce[1:], eps))
    keep = tops >= floor
    search = Search(
        starts[keep], tops[keep], fill, incumbent=incumbent, sum_holds_max=sum_holds_max
    )
    result = None
    while len(p := search.probes(min(PROBES, max(1, ROWS // bmax)))):
        S, M, back = run_dp(ce, np.tile(bs, len(p)), np.repeat(search.tops[p], bmax), values)
        S, M = S.reshape(len(p), bmax), M.reshape(len(p), bmax)
        total, splits = knapsack(S + extra, batch)
        # No split (total inf): peak 0, so T stays inf even with fill 0 (one stage).
        peak = np.array([max((M[r, b - 1] for b in s), default=0.0) for r, s in enumerate(splits)])
        k = search.report(p, total, total + fill * peak, peak)
        if k >= 0:
            ts = tuple(trace(back[k * bmax + b - 1], granularity) for b in splits[k])
            objective = float(total[k] + fill * peak[k])
            result = JointResult(tuple(splits[k]), ts, objective, float(peak[k]))
    return result
