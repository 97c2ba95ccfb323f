"""GPipe's partitioning by cost: K contiguous cells whose estimated costs vary least.

GPipe (Huang et al., 2019, §2.2) takes a cost estimate c_i per layer and "minimizes the
variance in the estimated costs of all cells": with the total fixed, that is the least
sum of squared cell costs. :func:`balance` finds it exactly with a dynamic program over
(cells, layers), O(K N^2); ties go to the smaller largest cell. The cost of a layer is
its forward + backward time from a :class:`~tplib.partition.chain.LayerChain` (so the
embeddings and the LM head make the end cells take fewer blocks), or any sequence of
non-negative numbers.

A cell is a layer range ``[lo, hi)`` as everywhere in tplib, so the result is directly a
runtime's ``Parallelism(stage_ranges=...)``, a run's layout.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tplib.nn.layer_ranges import StageRange
from tplib.partition.chain import LayerChain

__all__ = ["balance", "cell_costs"]


def cell_costs(costs: Sequence[float], ranges: Sequence[StageRange]) -> list[float]:
    """The estimated cost of each cell: the sum of its layers' costs."""
    return [float(sum(costs[lo:hi])) for lo, hi in ranges]


def balance(chain: LayerChain | Sequence[float], n_stages: int) -> tuple[StageRange, ...]:
    """The ``n_stages`` contiguous cells of least cost variance (see the module docstring)."""
    costs = (
        np.array([x.compute for x in chain.layers], dtype=float)
        if isinstance(chain, LayerChain)
        else np.asarray(chain, dtype=float)
    )
    n = len(costs)
    if isinstance(n_stages, bool) or not isinstance(n_stages, int) or n_stages < 1:
        raise ValueError(f"n_stages={n_stages!r}: a pipeline needs at least one stage")
    if n_stages > n:
        raise ValueError(
            f"n_stages={n_stages} is more than the chain's {n} layers: every stage needs at "
            "least one layer"
        )
    if not np.all(np.isfinite(costs)) or np.any(costs < 0):
        raise ValueError(f"layer costs {costs.tolist()} must be finite and non-negative")
    prefix = np.concatenate([[0.0], np.cumsum(costs)])
    # cell[j, i]: cost of the cell of layers [j, i); only j < i is a cell.
    cell = prefix[None, :] - prefix[:, None]
    valid = np.triu(np.ones((n + 1, n + 1), dtype=bool), 1)
    sq = np.where(valid, cell**2, np.inf)
    big = np.where(valid, cell, np.inf)
    # best[k, i]: (sum of squares, largest cell) of the best k cells over layers [0, i).
    best = np.full((n_stages + 1, n + 1, 2), np.inf)
    best[0, 0] = 0.0
    back = np.zeros((n_stages + 1, n + 1), dtype=np.int64)
    for k in range(1, n_stages + 1):
        for i in range(k, n + 1):
            total = best[k - 1, :i, 0] + sq[:i, i]
            peak = np.maximum(best[k - 1, :i, 1], big[:i, i])
            # Lexicographic (sum of squares, then largest cell); sums of squares equal up
            # to rounding count as ties.
            lo = total.min()
            tied = np.flatnonzero(total <= lo * (1 + 1e-12) + 1e-300)
            j = int(tied[np.argmin(peak[tied])])
            best[k, i] = (total[j], peak[j])
            back[k, i] = j
    bounds, i = [n], n
    for k in range(n_stages, 0, -1):
        i = int(back[k, i])
        bounds.append(i)
    bounds.reverse()
    return tuple((bounds[k], bounds[k + 1]) for k in range(n_stages))
