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
from typing import Any, Literal

import numpy as np

from tplib.plan import Plan
from tplib.planner.dp import fill_factor, prepare, token_search
from tplib.planner.knapsack import joint_search, knapsack
from tplib.planner.memory import SliceMemory
from tplib.planner.memory_joint import fitting_joint
from tplib.sim.costs import SliceCostModel

__all__ = ["exact_joint", "paper_joint", "plan_slices"]


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
    total, splits = knapsack(np.array([[best[b].latency for b in range(1, bmax + 1)]]), batch)
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
    memory: SliceMemory | None = None,
    capacity: float | None = None,
) -> Plan:
    """One t_max for all units: per window, S*_b for every b, a knapsack over the batch
    split minimising ``sum S*_{b_d}``, plus ``(K - 1) / v * t_max`` once (v =
    ``n_chunks``): the true latency. ``per_batch_slice(b)``, if given, is added once per
    batch slice of b sequences (a zero-bubble schedule's fused weight gradients,
    :mod:`tplib.planner.zero_bubble`). With a ``memory`` model and a ``capacity`` in
    bytes, the fastest plan whose peak fits, or a feasible one where that is out of the
    DP's reach (:func:`~tplib.planner.memory_joint.fitting_joint` says which); raises
    :class:`~tplib.planner.memory.NothingFitsError` when none fits."""
    if (memory is None) != (capacity is None):
        raise ValueError(
            f"memory={memory!r}, capacity={capacity!r}: give both (a memory model and the "
            "bytes it must fit in) or neither"
        )
    if memory is not None and capacity is not None:
        return fitting_joint(
            cost,
            memory,
            capacity,
            seq_len=seq_len,
            batch=batch,
            n_stages=n_stages,
            granularity=granularity,
            eps=eps,
            max_batch_slice_size=max_batch_slice_size,
            per_batch_slice=per_batch_slice,
            n_chunks=n_chunks,
        )
    fill = fill_factor(n_stages, n_chunks)
    ce, bmax = prepare(cost, seq_len, batch, n_stages, granularity, eps, max_batch_slice_size)
    extra = np.array(
        [0.0 if per_batch_slice is None else per_batch_slice(b) for b in range(1, bmax + 1)]
    )
    found = joint_search(ce, batch=batch, fill=fill, eps=eps, granularity=granularity, extra=extra)
    assert found is not None  # every slice is allowed: the unlimited window yields a plan
    return Plan(found.sizes, found.slicings, found.objective, found.t_max, eps)


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
    memory: SliceMemory | None = None,
    capacity: float | None = None,
) -> Plan:
    """The planner's entry point: ``exact_joint`` (default) or the paper's ``paper_joint``.
    ``Plan.latency`` is the chosen objective's prediction; batch slices never exceed
    ``max_batch_slice_size`` nor the cost model's own ``max_batch_slice_size``.
    ``n_chunks``: v, for ``terapipe-interleaved`` with v chunks per stage (``cost`` then
    prices a stage's v chunks, each with its messages). ``memory`` and ``capacity``
    (bytes): only plans whose peak fits (``exact`` only; see :func:`exact_joint`)."""
    methods = {"exact": exact_joint, "paper": paper_joint}
    if method not in methods:
        raise ValueError(f"method={method!r}: choose 'exact' or 'paper'")
    common: dict[str, Any] = dict(
        seq_len=seq_len,
        batch=batch,
        n_stages=n_stages,
        granularity=granularity,
        eps=eps,
        max_batch_slice_size=max_batch_slice_size,
        n_chunks=n_chunks,
    )
    if method == "exact":
        return exact_joint(cost, **common, memory=memory, capacity=capacity)
    if memory is not None or capacity is not None:
        raise ValueError(
            "method='paper' with a memory limit: the memory-aware planner minimises the "
            "true fill-drain latency; use method='exact'"
        )
    return paper_joint(cost, **common)
