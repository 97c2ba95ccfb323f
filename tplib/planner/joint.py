"""Joint batch x token plans (paper §3.4): how to split the batch, and slice each part.

Two objectives over the same token DP (:mod:`tplib.planner.dp`):

* :func:`paper_joint`, the paper's: the token DP for every batch-slice size b, then a
  knapsack over the batch split minimising ``sum_d T_{b_d}``. It counts the fill term
  ``(K - 1) t_max`` once per batch slice.
* :func:`exact_joint`: one ``t_max`` shared by all units; per eps-window, S*_b for every
  b, a knapsack over the batch split minimising ``sum S*_{b_d}``, plus ``(K - 1) * t_max``
  once: the true fill-drain latency, searched by the same branch and bound.

:func:`plan_slices` is the planner's entry point and picks one of them. Both take
``n_chunks`` v, the chunks per stage of ``terapipe-interleaved`` (or ``terapipe-bfs``),
whose fill term is ``(K - 1) / v * t_max`` (:mod:`tplib.planner.dp` says when that is
exact); with v = 1 it is TeraPipe's objective.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import numpy as np

from tplib.plan import Plan
from tplib.planner.dp import (
    Search,
    bottleneck,
    fill_factor,
    prepare,
    run_dp,
    token_search,
    trace,
    windows,
)
from tplib.sim.costs import SliceCostModel

__all__ = ["exact_joint", "paper_joint", "plan_slices"]

ROWS = 128  # DP rows per sweep in exact_joint (one row per batch-slice size per probe)


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
    cost: SliceCostModel,
    *,
    seq_len: int,
    batch: int,
    n_stages: int,
    granularity: int = 8,
    eps: float = 0.0,
    max_batch_slice_size: int | None = None,
    n_chunks: int = 1,
) -> Plan:
    """§3.4: the token DP for every batch-slice size b, then the batch split minimising
    ``sum_d T_{b_d}``; ``Plan.latency`` is that sum (fill term counted per batch slice)."""
    fill = fill_factor(n_stages, n_chunks)
    ce, bmax = prepare(cost, seq_len, batch, n_stages, granularity, eps, max_batch_slice_size)
    best = token_search(ce, range(1, bmax + 1), fill, eps, granularity)
    total, splits = _knapsack(np.array([[best[b].latency for b in range(1, bmax + 1)]]), batch)
    sizes = splits[0]
    return Plan(
        tuple(sizes),
        tuple(best[b].slices for b in sizes),
        float(total[0]),
        max(best[b].t_max for b in sizes),
        eps,
    )


def exact_joint(
    cost: SliceCostModel,
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
    """One t_max for all units: per window, S*_b for every b, a knapsack over the batch
    split minimising ``sum S*_{b_d}``, plus ``(K - 1) / v * t_max`` once (v =
    ``n_chunks``): the true latency. ``per_batch_slice(b)``, if given, is added once per
    batch slice of b sequences (a zero-bubble schedule's fused weight gradients,
    :mod:`tplib.planner.zero_bubble`)."""
    fill = fill_factor(n_stages, n_chunks)
    ce, bmax = prepare(cost, seq_len, batch, n_stages, granularity, eps, max_batch_slice_size)
    bs = np.arange(1, bmax + 1)
    extra = np.array([0.0 if per_batch_slice is None else per_batch_slice(int(b)) for b in bs])
    starts, tops = windows(np.unique(ce[1:][np.isfinite(ce[1:])]), eps)
    floor = bottleneck(ce, bs).min()
    search = Search(starts[tops >= floor], tops[tops >= floor], fill)
    result = None
    while len(p := search.probes(max(1, ROWS // bmax))):
        S, M, back = run_dp(ce, np.tile(bs, len(p)), np.repeat(search.tops[p], bmax))
        S, M = S.reshape(len(p), bmax), M.reshape(len(p), bmax)
        total, splits = _knapsack(S + extra, batch)
        peak = np.array(
            [max((M[r, b - 1] for b in s), default=np.inf) for r, s in enumerate(splits)]
        )
        k = search.report(p, total, total + fill * peak)
        if k >= 0:
            ts = tuple(trace(back[k * bmax + b - 1], granularity) for b in splits[k])
            result = (splits[k], ts, float(total[k] + fill * peak[k]), peak[k])
    assert result is not None  # the unlimited window always yields a plan
    return Plan(tuple(result[0]), result[1], result[2], float(result[3]), eps)


def plan_slices(
    cost: SliceCostModel,
    *,
    seq_len: int,
    batch: int,
    n_stages: int,
    granularity: int = 8,
    eps: float = 0.0,
    method: Literal["exact", "paper"] = "exact",
    max_batch_slice_size: int | None = None,
    n_chunks: int = 1,
) -> Plan:
    """The planner's entry point: ``exact_joint`` (default) or the paper's ``paper_joint``.
    ``Plan.latency`` is the chosen objective's prediction; batch slices never exceed
    ``max_batch_slice_size`` nor the cost model's own ``max_batch_slice_size``.
    ``n_chunks``: v, for ``terapipe-interleaved`` with v chunks per stage (``cost`` then
    prices a stage's v chunks, each with its messages)."""
    methods = {"exact": exact_joint, "paper": paper_joint}
    if method not in methods:
        raise ValueError(f"method={method!r}: choose 'exact' or 'paper'")
    return methods[method](
        cost,
        seq_len=seq_len,
        batch=batch,
        n_stages=n_stages,
        granularity=granularity,
        eps=eps,
        max_batch_slice_size=max_batch_slice_size,
        n_chunks=n_chunks,
    )
