"""The cost grid: every slice time the DP reads, asked of the cost model once.

Slice lengths and contexts live on a grid of ``g`` tokens (``n = L / g`` steps, see
:func:`tplib.plan.grid_size`). :func:`slice_time_table` asks the cost model for t(b, l, c) at
every grid point with ``l + c <= L`` for each batch-slice size ``b``, in one call per
``b``, and refuses a NaN, infinite or negative time by naming the slice.
:class:`TableCost` is the inverse: a cost model that reads an explicit table.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tplib.plan import grid_size
from tplib.sim.costs import SliceCostModel

__all__ = ["TableCost", "by_end", "check_batch_slice_size", "check_costs", "slice_time_table"]


class TableCost:
    """Slice times from an explicit table: ``times[b - 1, k, j]`` is the time of a slice of
    ``b`` sequences, ``k * granularity`` tokens long, after ``j * granularity`` tokens."""

    def __init__(self, times: np.ndarray | Sequence[np.ndarray], granularity: int = 8) -> None:
        self.times = np.asarray(times, dtype=float)
        if self.times.ndim != 3 or self.times.shape[1] != self.times.shape[2]:
            raise ValueError(f"TableCost times need shape (B, n+1, n+1), not {self.times.shape}")
        self.granularity = granularity

    @property
    def max_batch_slice_size(self) -> int:
        return self.times.shape[0]

    def slice_time(
        self, batch_slice_size: int, length: np.ndarray, context: np.ndarray
    ) -> np.ndarray:
        length, context, g = np.asarray(length), np.asarray(context), self.granularity
        if not 1 <= batch_slice_size <= self.max_batch_slice_size:
            raise ValueError(
                f"TableCost has batch slice sizes 1..{self.max_batch_slice_size}, "
                f"not {batch_slice_size}"
            )
        if np.any(length % g) or np.any(context % g) or np.any(length < g) or np.any(context < 0):
            raise ValueError(f"TableCost holds positive multiples of granularity={g} only")
        if np.any((length + context) // g >= self.times.shape[1]):
            raise ValueError(f"TableCost covers {(self.times.shape[1] - 1) * g} tokens at most")
        return self.times[batch_slice_size - 1, length // g, context // g]


def check_costs(t: np.ndarray, batch: int, length: np.ndarray, context: np.ndarray) -> None:
    """Raise ``ValueError`` naming the first slice whose time is not finite and >= 0."""
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


def check_batch_slice_size(cost: SliceCostModel, size: int) -> None:
    """Raise ``ValueError`` if the cost model has no times for batch slices of ``size``."""
    profiled = cost.max_batch_slice_size
    if profiled is not None and size > profiled:
        raise ValueError(
            f"batch slice of {size} sequences exceeds the cost model's "
            f"max_batch_slice_size={profiled}: split the batch (e.g. "
            "plan(..., max_batch_slice_size=...)) or profile larger batch slices"
        )


def slice_time_table(
    cost: SliceCostModel, *, seq_len: int, max_batch_slice_size: int, granularity: int = 8
) -> np.ndarray:
    """``grid[b, k, j]`` = time of a slice of ``b`` sequences, ``k * g`` tokens long after
    ``j * g`` tokens of context, for ``b <= max_batch_slice_size``, ``k >= 1``,
    ``k + j <= n``; inf elsewhere. The cost model is called once per batch-slice size and
    validated."""
    n = grid_size(seq_len, granularity)
    k, j = np.nonzero(np.add.outer(np.arange(n + 1), np.arange(n + 1)) <= n)
    k, j = k[k > 0], j[k > 0]
    grid = np.full((max_batch_slice_size + 1, n + 1, n + 1), np.inf)
    for b in range(1, max_batch_slice_size + 1):
        length, context = k * granularity, j * granularity
        t = np.asarray(cost.slice_time(b, length, context), dtype=float)
        t = np.broadcast_to(t, k.shape)
        check_costs(t, b, length, context)
        grid[b, k, j] = t
    return grid


def by_end(grid: np.ndarray) -> np.ndarray:
    """Re-index ``grid[b, k, j]`` as ``ce[b, i, j]``: the slice from grid position j to i,
    so the DP's inner min over slice starts reads one contiguous row."""
    n = grid.shape[1] - 1
    i, j = np.tril_indices(n + 1, -1)
    ce = np.full_like(grid, np.inf)
    ce[:, i, j] = grid[:, i - j, j]
    return ce
