"""Seq1F1B's slicing (Sun et al., NAACL 2025): every token slice the same FLOPs.

Seq1F1B cuts each sequence into k segments of equal work and runs 1F1B over them
(tplib's ``1f1b`` over token slices is that order). A token at position p (0-based)
costs ``linear`` FLOPs in the layer's products and ``attention`` FLOPs for each of the
p + 1 keys it attends to causally, so the first x tokens cost

    F(x) = linear * x + attention * x (x + 1) / 2,

and the boundaries solve F(x_i) = i F(L) / k by the quadratic formula (stable form
x = 2 F / (a + sqrt(a^2 + 2 attention F)), a = linear + attention / 2), then go to the
grid point of g tokens whose F is nearest, each slice at least one step long
(:func:`equal_flop_slices`). For a GPT layer :meth:`FlopModel.of` takes 24 h^2 per token
and 4 h per (query, key) pair (the forward's multiply-adds, twice; the backward scales
both alike, so only their ratio matters).

:func:`seq1f1b_plan` applies one slicing to every batch slice; :func:`best_seq1f1b`
picks k by the planner's objective (Eq. 5) on a cost model, optionally among the k whose
peak fits a memory capacity; :func:`compare_with_dp` sets TeraPipe's DP beside it on the
same cost model and grid, where the DP is never slower (it searches every slicing on the
grid, Seq1F1B's included).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tplib.nn.configs import GPTConfig
from tplib.plan import Plan, grid_size
from tplib.planner.cost_table import check_batch_slice_size, check_costs
from tplib.planner.dp import fill_factor
from tplib.planner.evaluate import pipeline_latency
from tplib.planner.joint import exact_joint
from tplib.planner.memory import NothingFitsError, SliceMemory, peak_bytes
from tplib.sim.costs import SliceCostModel

__all__ = [
    "Comparison",
    "FlopModel",
    "best_seq1f1b",
    "compare_with_dp",
    "equal_flop_slices",
    "seq1f1b_plan",
]


@dataclass(frozen=True)
class FlopModel:
    """FLOPs per token of the position-free work (``linear``) and per (query, key)
    pair of causal attention (``attention``)."""

    linear: float
    attention: float

    def __post_init__(self) -> None:
        for name in ("linear", "attention"):
            x = getattr(self, name)
            if isinstance(x, bool) or not isinstance(x, int | float) or not 0 <= x < math.inf:
                raise ValueError(f"FlopModel.{name}={x!r}: must be finite FLOPs >= 0")
        if self.linear == self.attention == 0:
            raise ValueError("FlopModel with linear = attention = 0: a token must cost FLOPs")

    @classmethod
    def of(cls, cfg: GPTConfig) -> FlopModel:
        """One GPT layer: 24 h^2 per token (QKV, projection, two MLP products), 4 h per
        (query, key) pair (scores and the weighted sum)."""
        return cls(24.0 * cfg.hidden**2, 4.0 * cfg.hidden)

    def cumulative(self, x: np.ndarray | float) -> np.ndarray:
        """F(x): the FLOPs of the first ``x`` tokens."""
        x = np.asarray(x, dtype=float)
        return self.linear * x + self.attention * x * (x + 1) / 2

    def slice_flops(self, length: np.ndarray, context: np.ndarray) -> np.ndarray:
        """FLOPs of ``length`` tokens after ``context`` tokens."""
        end = np.asarray(context) + np.asarray(length)
        return self.cumulative(end) - self.cumulative(context)

    def position_of(self, flops: np.ndarray) -> np.ndarray:
        """F^{-1}: the (real) x with F(x) = ``flops``."""
        a, f = self.linear + self.attention / 2, np.asarray(flops, dtype=float)
        return 2 * f / (a + np.sqrt(a * a + 2 * self.attention * f))


def _check_count(name: str, n: object) -> int:
    if isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 1:
        raise ValueError(f"{name}={n!r} must be a positive integer")
    return int(n)


def equal_flop_slices(
    flops: FlopModel, seq_len: int, n_slices: int, granularity: int = 8
) -> tuple[int, ...]:
    """``n_slices`` token-slice lengths, multiples of ``granularity`` summing to
    ``seq_len``, whose FLOPs are as equal as the grid allows (see the module docstring)."""
    k = _check_count("n_slices", n_slices)
    n = grid_size(_check_count("seq_len", seq_len), _check_count("granularity", granularity))
    if k > n:
        raise ValueError(
            f"n_slices={k} exceeds the {n} grid steps of L={seq_len}, g={granularity}: each "
            "slice is at least one step long"
        )
    at = flops.cumulative(granularity * np.arange(n + 1))
    targets = np.arange(1, k) * at[-1] / k
    above = np.clip(np.searchsorted(at, targets), 1, n)
    nearer = np.where(targets - at[above - 1] <= at[above] - targets, above - 1, above)
    # Strictly increasing, room for the rest: c_i = x_i - i non-decreasing, in [0, n - k].
    c = np.minimum(np.maximum.accumulate(np.maximum(nearer - np.arange(1, k), 0)), n - k)
    bounds = np.concatenate(([0], c + np.arange(1, k), [n]))
    return tuple(int(s) * granularity for s in np.diff(bounds))


def seq1f1b_plan(
    flops: FlopModel,
    *,
    seq_len: int,
    batch_slices: Sequence[int],
    n_slices: int,
    granularity: int = 8,
) -> Plan:
    """The batch split ``batch_slices`` (sequences per batch slice), each batch slice
    cut into the same ``n_slices`` equal-FLOP token slices."""
    tokens = equal_flop_slices(flops, seq_len, n_slices, granularity)
    sizes = tuple(batch_slices)
    return Plan(sizes, (tokens,) * len(sizes))


def best_seq1f1b(
    cost: SliceCostModel,
    flops: FlopModel,
    *,
    seq_len: int,
    batch: int,
    n_stages: int,
    granularity: int = 8,
    batch_slice_size: int = 1,
    n_slices: int | Sequence[int] | None = None,
    n_chunks: int = 1,
    memory: SliceMemory | None = None,
    capacity: float | None = None,
) -> Plan:
    """Seq1F1B on batch slices of ``batch_slice_size`` sequences, with the k of
    ``n_slices`` (default: every k from 1 to L / g) whose plan has the least
    ``sum t + (K - 1) / v max t`` under ``cost`` (Eq. 5); with ``memory`` and
    ``capacity`` only the k whose peak fits (:class:`NothingFitsError` if none does).
    ``Plan.latency`` is that objective, ``Plan.t_max`` the largest slice time."""
    size, batch = _check_count("batch_slice_size", batch_slice_size), _check_count("batch", batch)
    n = grid_size(_check_count("seq_len", seq_len), _check_count("granularity", granularity))
    fill = fill_factor(n_stages, n_chunks)
    if batch % size:
        raise ValueError(
            f"batch_slice_size={size} does not divide batch={batch}: Seq1F1B's batch slices "
            "are equal"
        )
    if (memory is None) != (capacity is None):
        raise ValueError("give both memory and capacity, or neither")
    check_batch_slice_size(cost, size)
    ks = (
        list(range(1, n + 1))
        if n_slices is None
        else [n_slices]
        if isinstance(n_slices, int)
        else list(n_slices)
    )
    if not ks:
        raise ValueError("n_slices is empty: give at least one slice count")
    slicings = [equal_flop_slices(flops, seq_len, k, granularity) for k in ks]
    # Every candidate's slices priced in one call.
    length = np.concatenate([np.asarray(s) for s in slicings])
    context = np.concatenate([np.cumsum(s) - np.asarray(s) for s in slicings])
    t = np.broadcast_to(np.asarray(cost.slice_time(size, length, context), float), length.shape)
    check_costs(t, size, length, context)
    starts = np.cumsum([0, *ks[:-1]])
    copies = batch // size
    t_max = np.maximum.reduceat(t, starts)
    latency = copies * np.add.reduceat(t, starts) + fill * t_max
    order = np.argsort(latency, kind="stable")  # fastest first; a Plan only when asked

    def plan(i: int) -> Plan:
        return Plan((size,) * copies, (slicings[i],) * copies, float(latency[i]), float(t_max[i]))

    if memory is None or capacity is None:
        return plan(int(order[0]))
    least = math.inf
    for i in order:
        p = plan(int(i))
        if (peak := peak_bytes(p, memory)) <= capacity:
            return p
        least = min(least, peak)
    raise NothingFitsError(
        f"no Seq1F1B slicing (k in {min(ks)}..{max(ks)}, batch slices of {size}) fits in "
        f"{capacity / 2**30:.3f} GiB: the smallest peak among them is {least / 2**30:.3f} GiB",
        least,
    )


@dataclass(frozen=True)
class Comparison:
    """TeraPipe's DP plan and Seq1F1B's plan on the same cost model and grid, each with
    its ``sum t + (K - 1) / v max t``."""

    dp: Plan
    seq1f1b: Plan
    dp_latency: float
    seq1f1b_latency: float

    @property
    def margin(self) -> float:
        """How much slower Seq1F1B's plan is than the DP's: latency ratio less 1 (>= 0
        at eps = 0, since the DP's search holds Seq1F1B's plan)."""
        return self.seq1f1b_latency / self.dp_latency - 1


def compare_with_dp(
    cost: SliceCostModel,
    flops: FlopModel,
    *,
    seq_len: int,
    batch: int,
    n_stages: int,
    granularity: int = 8,
    batch_slice_size: int = 1,
    n_slices: int | Sequence[int] | None = None,
    eps: float = 0.0,
    n_chunks: int = 1,
) -> Comparison:
    """The DP's plan (:func:`~tplib.planner.joint.exact_joint`) against
    :func:`best_seq1f1b`'s, both priced by :func:`~tplib.planner.evaluate.pipeline_latency`
    on ``cost``. With ``eps`` > 0 the DP may lose by up to (K - 1) / v eps."""
    seq = best_seq1f1b(
        cost,
        flops,
        seq_len=seq_len,
        batch=batch,
        n_stages=n_stages,
        granularity=granularity,
        batch_slice_size=batch_slice_size,
        n_slices=n_slices,
        n_chunks=n_chunks,
    )
    dp = exact_joint(
        cost,
        seq_len=seq_len,
        batch=batch,
        n_stages=n_stages,
        granularity=granularity,
        eps=eps,
        n_chunks=n_chunks,
    )
    return Comparison(
        dp,
        seq,
        pipeline_latency(dp, cost, n_stages, n_chunks),
        pipeline_latency(seq, cost, n_stages, n_chunks),
    )
