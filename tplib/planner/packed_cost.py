"""Slice times on packed rows: a cost model over per-document contexts.

A packed row holds several documents, and attention is masked per document
(:mod:`tplib.documents`): a token sees itself and its own document's earlier tokens. A
slice's work then splits in two.

- Work that does not depend on the documents: the linear layers (QKV, projection, MLP),
  layer norms, the messages between stages and the per-slice overheads. It grows with
  the slice's tokens ``l`` alone, and with its batch-slice size ``b``.
- Work that does: the attention core, which computes one score (and one weighted value)
  per query-key *pair*. A slice ``[s, e)`` of row ``r`` computes ``P_r(e) - P_r(s)``
  pairs (:meth:`~tplib.documents.Documents.pairs_prefix`), whatever the slicing; in an
  unpacked row that is ``pairs(l, c) = l c + l (l + 1) / 2``.

:class:`PackedCost` states this per batch-slice size ``b`` as::

    t(b, l, pairs) = f_b(l) + gamma_b * pairs

where ``f_b`` is the pair-free curve over the slice's length. :meth:`PackedCost.fit`
takes both from any :class:`~tplib.sim.costs.SliceCostModel` on the planner's unpacked
grid (``l``, ``c`` multiples of ``g``, ``l + c <= L``): ``f_b(l)`` is the model's own time
of a slice without context, ``t(b, l, 0)``, less ``gamma_b`` times its causal pairs
``l (l + 1) / 2``, so a slice without context costs exactly what the model says, host
floors and an underused GPU included; ``gamma_b`` is the least-squares slope (on
relative error) of what context adds, ``t(b, l, c) - t(b, l, 0)`` against the ``l c``
pairs it brings. :attr:`PackedCost.residual` is the fit's worst relative error there. A
batch slice of rows ``R`` (``|R| = b``) running slice ``[s, e)`` then costs
``f_b(e - s) + gamma_b * mean_{r in R} (P_r(e) - P_r(s))``. :meth:`PackedCost.linear`
builds the model ``a_b + alpha_b l + gamma_b pairs`` directly.

Limits. The model prices a packed slice as one kernel per layer over all its segments
(FlashAttention's variable-length form): no overhead per segment, which a kernel launch
per document would add. A written-out attention that computes the whole score rectangle
and masks it (the paper's implementation) does the same work whatever the documents; its
``l (c + l)`` scores are fitted by pairs on unpacked rows, so on packed rows the model
credits it with savings it does not have. Where context's cost is not proportional to
its pairs, the fit bends it straight: :attr:`PackedCost.residual` says by how much.

Also here: :func:`packed_latency`, a plan's fill-drain latency ``sum t + (K - 1) / v *
max t`` on packed rows, the yardstick the packed planner and its baselines are compared
on. Plain numpy: nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

import numpy as np

from tplib.documents import Documents
from tplib.plan import Plan, grid_size
from tplib.planner.cost_table import check_batch_slice_size, slice_time_table
from tplib.planner.dp import fill_factor
from tplib.sim.costs import SliceCostModel

__all__ = ["PackedCost", "packed_latency", "packed_unit_times", "unpacked_pairs"]


def unpacked_pairs(length: np.ndarray, context: np.ndarray) -> np.ndarray:
    """Query-key pairs of causal attention for ``length`` queries after ``context`` keys
    of the same document: ``l c + l (l + 1) / 2``."""
    length, context = np.asarray(length, dtype=float), np.asarray(context, dtype=float)
    return length * context + length * (length + 1) / 2


@dataclass(frozen=True)
class PackedCost:
    """``t(b, l, pairs) = pair_free[b-1](l) + per_pair[b-1] * pairs`` (see the module
    docstring) for batch slices of 1..``len(per_pair)`` rows; ``pair_free[b-1][k]`` is the
    pair-free time of a slice of ``k * granularity`` tokens (k = 0..n), interpolated in
    between; ``residual``: the worst relative error of the fit it came from (0 if given)."""

    pair_free: tuple[tuple[float, ...], ...]  # f_b(k g): seconds, the pairs taken out
    per_pair: tuple[float, ...]  # gamma_b, seconds per query-key pair (per row, mean)
    granularity: int = 8
    residual: float = 0.0

    def __post_init__(self) -> None:
        n = len(self.per_pair)
        if n < 1 or len(self.pair_free) != n or len({len(f) for f in self.pair_free}) != 1:
            raise ValueError(
                f"PackedCost with {len(self.pair_free)} pair-free curves and {n} pair "
                "coefficients: give one of each per batch-slice size 1..B, the curves all "
                "over the same grid"
            )
        if len(self.pair_free[0]) < 2 or self.granularity < 1:
            raise ValueError(
                f"PackedCost curves of {len(self.pair_free[0])} points at granularity "
                f"{self.granularity}: need at least the points 0 and g"
            )
        if (
            not np.isfinite(np.array([*self.pair_free], dtype=float)).all()
            or not np.isfinite(self.per_pair).all()
        ):
            raise ValueError("PackedCost times and coefficients must all be finite")

    @classmethod
    def linear(
        cls,
        intercept: tuple[float, ...],
        per_token: tuple[float, ...],
        per_pair: tuple[float, ...],
        *,
        seq_len: int,
        granularity: int = 8,
    ) -> PackedCost:
        """The linear model ``a_b + alpha_b l + gamma_b pairs`` on the grid up to
        ``seq_len``."""
        steps = np.arange(grid_size(seq_len, granularity) + 1) * float(granularity)
        curves = tuple(
            tuple(a + alpha * steps) for a, alpha in zip(intercept, per_token, strict=True)
        )
        return cls(curves, tuple(per_pair), granularity)

    @classmethod
    def fit(
        cls,
        model: SliceCostModel,
        *,
        seq_len: int,
        max_batch_slice_size: int,
        granularity: int = 8,
    ) -> PackedCost:
        """Fit ``model`` per batch-slice size 1..``max_batch_slice_size`` on the grid of
        ``granularity`` tokens up to ``seq_len``: the pair-free curve is the model's own
        time without context less the pairs of causal attention in the slice, and
        ``gamma_b`` the least squares (on relative error) of what context adds."""
        if max_batch_slice_size < 1:
            raise ValueError(f"max_batch_slice_size={max_batch_slice_size} must be >= 1")
        check_batch_slice_size(model, max_batch_slice_size)
        g = granularity
        grid = slice_time_table(
            model, seq_len=seq_len, max_batch_slice_size=max_batch_slice_size, granularity=g
        )
        k, j = np.nonzero(np.isfinite(grid[1]))
        length, context = k * g, j * g
        steps = np.arange(grid.shape[1]) * float(g)
        curves, gammas, worst = [], [], 0.0
        for b in range(1, max_batch_slice_size + 1):
            t, alone = grid[b, k, j], grid[b, k, 0]
            scale = np.maximum(t, t.max() * 1e-12 + 1e-300)  # relative, even at t = 0
            x = (length * context) / scale  # the pairs context adds, l c
            gamma = float((x * (t - alone) / scale).sum() / max((x * x).sum(), 1e-300))
            worst = max(worst, float((np.abs(alone + gamma * length * context - t) / scale).max()))
            base = np.concatenate([[0.0], grid[b, 1:, 0]])
            base[0] = base[1]  # a slice has at least g tokens; 0 only anchors interpolation
            curves.append(tuple(map(float, base - gamma * unpacked_pairs(steps, 0 * steps))))
            gammas.append(gamma)
        return cls(tuple(curves), tuple(gammas), g, worst)

    @property
    def max_batch_slice_size(self) -> int:
        return len(self.per_pair)

    def _check_size(self, b: int | np.ndarray) -> np.ndarray:
        i = np.asarray(b) - 1
        if np.any(i < 0) or np.any(i >= self.max_batch_slice_size):
            raise ValueError(
                f"batch slice of {np.asarray(b).tolist()} rows: this PackedCost prices "
                f"1..{self.max_batch_slice_size} (fit it with a larger max_batch_slice_size)"
            )
        return i

    def free_time(self, b: int, length: np.ndarray | float) -> np.ndarray:
        """``f_b(l)``: the pair-free seconds of slices of ``length`` tokens."""
        curve = np.asarray(self.pair_free[int(self._check_size(b))])
        steps = np.arange(len(curve)) * float(self.granularity)
        length = np.asarray(length, dtype=float)
        if np.any(length > steps[-1]):
            raise ValueError(
                f"slices of {length.max()} tokens: this PackedCost covers {steps[-1]:g}"
            )
        return np.interp(length, steps, curve)

    def bound(self, b: int | np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(a_b, alpha_b, gamma_b)``: a line ``a_b + alpha_b l`` at or below the pair-free
        curve at every grid point (least squares, then lowered), and the pair coefficient:
        what the packed planner's window bound needs."""
        i = self._check_size(b)
        curves = np.asarray(self.pair_free, dtype=float)
        steps = np.arange(curves.shape[1]) * float(self.granularity)
        a, alpha = [], []
        for curve in curves:
            slope = float(np.polyfit(steps[1:], curve[1:], 1)[0]) if len(steps) > 2 else 0.0
            alpha.append(slope)
            a.append(float((curve[1:] - slope * steps[1:]).min()))
        return np.asarray(a)[i], np.asarray(alpha)[i], np.asarray(self.per_pair)[i]

    def slice_time(
        self, batch_slice_size: int, length: np.ndarray, context: np.ndarray
    ) -> np.ndarray:
        """The model on unpacked rows (a :class:`~tplib.sim.costs.SliceCostModel`)."""
        gamma = self.per_pair[int(self._check_size(batch_slice_size))]
        length = np.asarray(length, dtype=float)
        return self.free_time(batch_slice_size, length) + gamma * unpacked_pairs(length, context)

    def unit_time(self, documents: Documents, start: int, end: int) -> float:
        """Seconds of one stage for token slice ``[start, end)`` of a batch slice whose
        rows are ``documents``."""
        if not 0 <= start < end <= documents.seq_len:
            raise ValueError(
                f"token slice [{start}, {end}) of rows of {documents.seq_len} tokens: need "
                "0 <= start < end <= seq_len"
            )
        P = documents.pairs_prefix()
        b = documents.batch
        gamma = self.per_pair[int(self._check_size(b))]
        return float(self.free_time(b, end - start) + gamma * (P[:, end] - P[:, start]).mean())

    def grid(self, documents: Documents, granularity: int = 8) -> np.ndarray:
        """The by-end grid ``ce[i, j]``: seconds of the slice from token ``j g`` to ``i g``
        of a batch slice whose rows are ``documents`` (inf where ``j >= i``), the layout
        :func:`~tplib.planner.dp.run_dp` reads."""
        grid_size(documents.seq_len, granularity)
        Q = documents.pairs_prefix()[:, ::granularity].mean(axis=0)
        return self.range_grids(np.array([documents.batch]), Q[None], granularity)[0]

    def range_grids(self, sizes: np.ndarray, Q: np.ndarray, granularity: int) -> np.ndarray:
        """By-end grids of many batch slices at once: batch slice ``r`` has ``sizes[r]``
        rows whose mean pairs prefix on the grid is ``Q[r]`` (shape (R, n + 1))."""
        sizes = np.asarray(sizes)
        gamma = np.asarray(self.per_pair)[self._check_size(sizes)]
        n = Q.shape[1] - 1
        steps = np.subtract.outer(np.arange(n + 1), np.arange(n + 1))
        ce = Q[:, :, None] - Q[:, None, :]
        ce *= gamma[:, None, None]
        # The pair-free part depends on the size alone: added per run of equal sizes, in
        # place (ranges listed by size make one run per size).
        free = {
            int(b): self.free_time(int(b), np.arange(n + 1) * float(granularity))
            for b in np.unique(sizes)
        }
        cuts = [0, *(np.flatnonzero(np.diff(sizes)) + 1).tolist(), len(sizes)]
        for x, y in pairwise(cuts):
            ce[x:y] += free[int(sizes[x])][np.maximum(steps, 0)]
        np.copyto(ce, np.inf, where=steps <= 0)
        return ce


def packed_unit_times(plan: Plan, cost: PackedCost, documents: Documents) -> np.ndarray:
    """Seconds of one stage for every unit of ``plan`` on the packed rows ``documents``,
    in forward order."""
    plan.check_covers(documents.batch, documents.seq_len)
    P = documents.pairs_prefix()
    out = []
    for b, size in enumerate(plan.batch_slices):
        first = plan.batch_offset(b)
        cuts = np.asarray(plan.token_bounds(b))
        pairs = np.diff(P[first : first + size][:, cuts], axis=1).mean(axis=0)
        out.append(cost.free_time(size, np.diff(cuts)) + cost.per_pair[size - 1] * pairs)
    return np.concatenate(out)


def packed_latency(
    plan: Plan, cost: PackedCost, documents: Documents, n_stages: int, n_chunks: int = 1
) -> float:
    """``sum t + (K - 1) / v * max t`` over every unit of ``plan`` on the packed rows
    ``documents`` (``v`` = ``n_chunks``): the fill-drain latency the packed planner
    minimises, for any plan covering the batch."""
    t = packed_unit_times(plan, cost, documents)
    return float(t.sum() + fill_factor(n_stages, n_chunks) * t.max())
