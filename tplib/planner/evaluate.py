"""Evaluating any plan on a slice cost model, and the uniform baseline of the ablation.

:func:`pipeline_latency` prices a plan (a :class:`~tplib.plan.Plan`, the paper's
notation, or (batch size, token lengths) pairs) by the true fill-drain latency
``sum t + (K - 1) * max t`` over all its units, the yardstick every planner and baseline
is compared on; with ``n_chunks`` v, by ``sum t + (K - 1) / v * max t``, the planner's
objective for ``terapipe-interleaved`` (:mod:`tplib.planner.dp`). :func:`uniform` cuts every batch slice into equal token slices (paper
Figure 6's baseline) and :func:`best_uniform` keeps the best number of them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tplib.plan import Plan, grid_size
from tplib.planner.cost_table import check_batch_slice_size, check_costs
from tplib.planner.dp import fill_factor
from tplib.sim.costs import SliceCostModel

__all__ = ["best_uniform", "pipeline_latency", "uniform"]


def _latency(t: np.ndarray, n_stages: int, n_chunks: int = 1) -> float:
    return float(t.sum() + fill_factor(n_stages, n_chunks) * t.max())


def _unit_times(p: Plan, cost: SliceCostModel) -> np.ndarray:
    out = []
    for size, tokens in zip(p.batch_slices, p.token_slices, strict=True):
        check_batch_slice_size(cost, size)
        length = np.asarray(tokens)
        context = np.cumsum(length) - length
        t = np.broadcast_to(np.asarray(cost.slice_time(size, length, context), float), length.shape)
        check_costs(t, size, length, context)
        out.append(t)
    return np.concatenate(out)


def pipeline_latency(
    plan_or_slices: Plan | str | Sequence[tuple[int, Sequence[int]]],
    cost: SliceCostModel,
    n_stages: int,
    n_chunks: int = 1,
) -> float:
    """``sum t + (K - 1) * max t`` over all units of any plan (a Plan, the paper's notation,
    or (batch size, token lengths) pairs): compares plans on the true fill-drain latency.
    With ``n_chunks`` v: ``sum t + (K - 1) / v * max t``."""
    p = plan_or_slices
    if isinstance(p, str):
        p = Plan.from_paper(p)
    elif not isinstance(p, Plan):
        p = Plan(tuple(b for b, _ in p), tuple(tuple(ts) for _, ts in p))
    return _latency(_unit_times(p, cost), n_stages, n_chunks)


def uniform(
    cost: SliceCostModel,
    seq_len: int,
    batch: int,
    n_stages: int,
    n_slices: int,
    batch_slice_size: int = 1,
    granularity: int = 8,
) -> Plan:
    """The ablation baseline: ``n_slices`` token slices as equal as the grid allows
    (longer first) in every batch slice of ``batch_slice_size`` sequences."""
    n = grid_size(seq_len, granularity)
    on_grid = Plan.uniform(batch, n, batch_slice_size=batch_slice_size, n_token_slices=n_slices)
    tokens = tuple(s * granularity for s in on_grid.token_slices[0])
    p = Plan(on_grid.batch_slices, (tokens,) * on_grid.n_batch_slices)
    t = _unit_times(p, cost)
    return Plan(p.batch_slices, p.token_slices, _latency(t, n_stages), float(t.max()))


def best_uniform(
    cost: SliceCostModel,
    seq_len: int,
    batch: int,
    n_stages: int,
    batch_slice_size: int = 1,
    granularity: int = 8,
) -> Plan:
    """The best of ``uniform`` over #slices = 1, 2, 4, ... (at most L / g)."""
    n = grid_size(seq_len, granularity)
    plans = [
        uniform(cost, seq_len, batch, n_stages, 2**e, batch_slice_size, granularity)
        for e in range(n.bit_length())  # 2**e <= n
    ]
    return min(plans, key=lambda p: p.latency if p.latency is not None else np.inf)
