"""The cost grid: every slice time the DP reads, asked of the cost model once.

Slice lengths and contexts live on a grid of ``g`` tokens (``n = L / g`` steps, see
:func:`tplib.plan.grid_size`). :func:`slice_time_table` asks the cost model for t(b, l, c) at
every grid point with ``l + c <= L`` for each batch-slice size ``b``, in one call per
``b``, and refuses a NaN, infinite or negative time by naming the slice.
:class:`TableCost` is the inverse: a cost model that reads an explicit table.

:func:`end_table` is the same grid indexed by where each slice ends, as the DP reads it.
Asking an analytic cluster model for every slice costs far more than the DP that reads
the answers (about 0.1 s for K = 96 stages at L = 2048, g = 8), and a training loop that
plans every batch asks the same model again and again; so the grid is kept, read-only,
per cost model object (by identity, for as long as the object lives, the least recently
used grids dropped beyond :data:`KEPT_CELLS` cells in all), and so is what the planner
derives from it (:func:`derive`). Like :func:`~tplib.sim.costs.memo`, this takes a cost
model's times as a pure function of the slice: a model must not change once it has
priced a plan (:class:`TableCost` copies its table and makes it read-only for that).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable, Sequence
from functools import partial
from typing import Any, TypeVar, cast

import numpy as np

from tplib.plan import grid_size
from tplib.sim.costs import SliceCostModel

__all__ = [
    "KEPT_CELLS",
    "TableCost",
    "by_end",
    "check_batch_slice_size",
    "check_costs",
    "derive",
    "end_table",
    "slice_time_table",
]

R = TypeVar("R")

KEPT_CELLS = 1 << 23  # grid cells kept in all, 64 MiB: the least recently used go first


class TableCost:
    """Slice times from an explicit table: ``times[b - 1, k, j]`` is the time of a slice of
    ``b`` sequences, ``k * granularity`` tokens long, after ``j * granularity`` tokens."""

    def __init__(self, times: np.ndarray | Sequence[np.ndarray], granularity: int = 8) -> None:
        # A copy, read-only: the planner keeps grids read from this model (see end_table).
        self.times = np.array(times, dtype=float)
        self.times.flags.writeable = False
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


def _ask(
    cost: SliceCostModel, seq_len: int, max_batch_slice_size: int, granularity: int, by_end: bool
) -> np.ndarray:
    n = grid_size(seq_len, granularity)
    k, j = np.nonzero(np.add.outer(np.arange(n + 1), np.arange(n + 1)) <= n)
    k, j = k[k > 0], j[k > 0]
    grid = np.full((max_batch_slice_size + 1, n + 1, n + 1), np.inf)
    row = k + j if by_end else k  # the same points asked in the same order either way
    for b in range(1, max_batch_slice_size + 1):
        length, context = k * granularity, j * granularity
        t = np.asarray(cost.slice_time(b, length, context), dtype=float)
        t = np.broadcast_to(t, k.shape)
        check_costs(t, b, length, context)
        grid[b, row, j] = t
    return grid


def slice_time_table(
    cost: SliceCostModel, *, seq_len: int, max_batch_slice_size: int, granularity: int = 8
) -> np.ndarray:
    """``grid[b, k, j]`` = time of a slice of ``b`` sequences, ``k * g`` tokens long after
    ``j * g`` tokens of context, for ``b <= max_batch_slice_size``, ``k >= 1``,
    ``k + j <= n``; inf elsewhere. The cost model is called once per batch-slice size and
    validated."""
    return _ask(cost, seq_len, max_batch_slice_size, granularity, by_end=False)


# (id of the cost model, seq_len, granularity) -> (a weak reference to the model, its
# by-end grid, what the planner derived from that grid), least recently used first. By
# identity: a model's equality need not say its times are the same.
_KEPT: dict[tuple[int, int, int], tuple[weakref.ref[Any], np.ndarray, dict[Hashable, Any]]] = {}


def _forget(model: int, _: object) -> None:
    for key in [k for k in _KEPT if k[0] == model]:
        del _KEPT[key]


def derive(ce: np.ndarray, key: Hashable, make: Callable[[], R]) -> R:
    """``make()``, what the planner derives from the grid ``ce`` alone (its floors, its
    t_max windows), kept under ``key`` with the grid while :func:`end_table` keeps it
    (``ce`` is then that grid or its leading batch-slice sizes); else made afresh."""
    base = ce.base if isinstance(ce.base, np.ndarray) else ce
    for _, grid, made in _KEPT.values():
        if grid is base and ce.shape[1:] == grid.shape[1:] and ce.ctypes.data == grid.ctypes.data:
            if key not in made:
                made[key] = make()
            return cast(R, made[key])
    return make()


def end_table(
    cost: SliceCostModel, *, seq_len: int, max_batch_slice_size: int, granularity: int = 8
) -> np.ndarray:
    """:func:`by_end` of :func:`slice_time_table`, read-only: ``ce[b, i, j]`` is the time
    of the slice from grid position j to i. Kept per cost model (see the module
    docstring); a grid kept for more batch-slice sizes serves fewer."""
    key = (id(cost), seq_len, granularity)
    kept = _KEPT.pop(key, None)
    if kept is not None and kept[0]() is cost:
        _KEPT[key] = kept  # now the most recently used
        if kept[1].shape[0] > max_batch_slice_size:
            return kept[1][: max_batch_slice_size + 1]
    ce = _ask(cost, seq_len, max_batch_slice_size, granularity, by_end=True)
    ce.flags.writeable = False
    try:
        ref = weakref.ref(cost, partial(_forget, id(cost)))
    except TypeError:  # no weak references (__slots__): not kept
        return ce
    if ce.size <= KEPT_CELLS:
        _KEPT[key] = (ref, ce, {})
        while sum(grid.size for _, grid, _ in _KEPT.values()) > KEPT_CELLS:
            del _KEPT[next(iter(_KEPT))]
    return ce


def by_end(grid: np.ndarray) -> np.ndarray:
    """Re-index ``grid[b, k, j]`` as ``ce[b, i, j]``: the slice from grid position j to i,
    so the DP's inner min over slice starts reads one contiguous row."""
    n = grid.shape[1] - 1
    i, j = np.tril_indices(n + 1, -1)
    ce = np.full_like(grid, np.inf)
    ce[:, i, j] = grid[:, i - j, j]
    return ce
