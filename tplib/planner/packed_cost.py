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

:class:`PackedCost` states this as a model linear in both, per batch-slice size ``b``::

    t(b, l, c) ~= a_b + alpha_b * l + gamma_b * pairs(l, c)

fitted (:meth:`PackedCost.fit`) by least squares on relative error to any
:class:`~tplib.sim.costs.SliceCostModel` over the planner's unpacked grid (``l``, ``c``
multiples of ``g``, ``l + c <= L``); :attr:`PackedCost.residual` is the fit's worst
relative error there. A batch slice of rows ``R`` (``|R| = b``) running slice ``[s, e)``
then costs ``a_b + alpha_b (e - s) + gamma_b * mean_{r in R} (P_r(e) - P_r(s))``: on
unpacked rows, exactly the fit.

Limits. The model prices a packed slice as one kernel per layer over all its segments
(FlashAttention's variable-length form): no overhead per segment, which a kernel launch
per document would add. A written-out attention that computes the whole score rectangle
and masks it (the paper's implementation) does the same work whatever the documents; its
``l (c + l)`` scores are fitted by pairs on unpacked rows, so on packed rows the model
credits it with savings it does not have. Where the source model is not linear (a host
floor on short slices, a GPU underused below some tokens) the fit bends it straight:
:attr:`PackedCost.residual` says by how much.

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
    """``t(b, l, pairs) = intercept[b-1] + per_token[b-1] * l + per_pair[b-1] * pairs``
    (see the module docstring), for batch slices of 1..``len(intercept)`` rows;
    ``residual``: the worst relative error of the fit it came from (0 if given)."""

    intercept: tuple[float, ...]  # a_b, seconds per slice
    per_token: tuple[float, ...]  # alpha_b, seconds per token of the slice (per row)
    per_pair: tuple[float, ...]  # gamma_b, seconds per query-key pair (per row, mean)
    residual: float = 0.0

    def __post_init__(self) -> None:
        n = len(self.intercept)
        if n < 1 or len(self.per_token) != n or len(self.per_pair) != n:
            raise ValueError(
                f"PackedCost with {len(self.intercept)}, {len(self.per_token)} and "
                f"{len(self.per_pair)} coefficients: give one of each per batch-slice size "
                "1..B, at least one"
            )
        coef = np.array([self.intercept, self.per_token, self.per_pair], dtype=float)
        if not np.isfinite(coef).all():
            raise ValueError(f"PackedCost coefficients {coef.tolist()} must all be finite")

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
        ``granularity`` tokens up to ``seq_len``, least squares on relative error."""
        if max_batch_slice_size < 1:
            raise ValueError(f"max_batch_slice_size={max_batch_slice_size} must be >= 1")
        check_batch_slice_size(model, max_batch_slice_size)
        grid = slice_time_table(
            model, seq_len=seq_len, max_batch_slice_size=max_batch_slice_size,
            granularity=granularity,
        )  # fmt: skip
        k, j = np.nonzero(np.isfinite(grid[1]))
        length, context = k * granularity, j * granularity
        X = np.stack([np.ones(len(k)), length, unpacked_pairs(length, context)], axis=1)
        coefs, worst = [], 0.0
        for b in range(1, max_batch_slice_size + 1):
            t = grid[b, k, j]
            scale = np.maximum(t, t.max() * 1e-12 + 1e-300)  # relative, even at t = 0
            # Columns scaled to unit size: pairs reach L^2 / 2, ones stay 1.
            norm = np.abs(X).max(axis=0)
            sol = np.linalg.lstsq(X / norm / scale[:, None], t / scale, rcond=None)[0] / norm
            worst = max(worst, float((np.abs(X @ sol - t) / scale).max()))
            coefs.append(sol)
        c = np.array(coefs)
        return cls(tuple(c[:, 0]), tuple(c[:, 1]), tuple(c[:, 2]), worst)

    @property
    def max_batch_slice_size(self) -> int:
        return len(self.intercept)

    def coefficients(self, b: int | np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(a_b, alpha_b, gamma_b)`` of batch-slice size(s) ``b``."""
        i = np.asarray(b) - 1
        if np.any(i < 0) or np.any(i >= self.max_batch_slice_size):
            raise ValueError(
                f"batch slice of {np.asarray(b).tolist()} rows: this PackedCost prices "
                f"1..{self.max_batch_slice_size} (fit it with a larger max_batch_slice_size)"
            )
        a, alpha, gamma = (
            np.asarray(x)[i] for x in (self.intercept, self.per_token, self.per_pair)
        )
        return a, alpha, gamma

    def slice_time(
        self, batch_slice_size: int, length: np.ndarray, context: np.ndarray
    ) -> np.ndarray:
        """The fit on unpacked rows (a :class:`~tplib.sim.costs.SliceCostModel`)."""
        a, alpha, gamma = self.coefficients(batch_slice_size)
        length = np.asarray(length, dtype=float)
        return a + alpha * length + gamma * unpacked_pairs(length, context)

    def unit_time(self, documents: Documents, start: int, end: int) -> float:
        """Seconds of one stage for token slice ``[start, end)`` of a batch slice whose
        rows are ``documents``."""
        if not 0 <= start < end <= documents.seq_len:
            raise ValueError(
                f"token slice [{start}, {end}) of rows of {documents.seq_len} tokens: need "
                "0 <= start < end <= seq_len"
            )
        P = documents.pairs_prefix()
        a, alpha, gamma = self.coefficients(documents.batch)
        return float(a + alpha * (end - start) + gamma * (P[:, end] - P[:, start]).mean())

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
        a, alpha, gamma = self.coefficients(sizes)
        n = Q.shape[1] - 1
        steps = np.subtract.outer(np.arange(n + 1), np.arange(n + 1)) * float(granularity)
        ce = Q[:, :, None] - Q[:, None, :]
        ce *= gamma[:, None, None]
        # The pair-free part depends on the size alone: added per run of equal sizes, in
        # place (ranges listed by size make one run per size).
        cuts = [0, *(np.flatnonzero(np.diff(sizes)) + 1).tolist(), len(sizes)]
        for x, y in pairwise(cuts):
            ce[x:y] += a[x] + alpha[x] * steps
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
        a, alpha, gamma = cost.coefficients(size)
        pairs = np.diff(P[first : first + size][:, cuts], axis=1).mean(axis=0)
        out.append(a + alpha * np.diff(cuts) + gamma * pairs)
    return np.concatenate(out)


def packed_latency(
    plan: Plan, cost: PackedCost, documents: Documents, n_stages: int, n_chunks: int = 1
) -> float:
    """``sum t + (K - 1) / v * max t`` over every unit of ``plan`` on the packed rows
    ``documents`` (``v`` = ``n_chunks``): the fill-drain latency the packed planner
    minimises, for any plan covering the batch."""
    t = packed_unit_times(plan, cost, documents)
    return float(t.sum() + fill_factor(n_stages, n_chunks) * t.max())
