"""The planner's objective for ``terapipe-zb``: split backwards, weight gradients fused
per sequence and run at the end of each stage.

Under ``terapipe-zb`` each stage runs every unit's forward and input-gradient backward
(``F``, ``B``) as ``terapipe`` runs F and B, then one ``W`` per batch slice over all of
its tokens. Only ``F`` and ``B`` are on the pipeline's critical path; the ``W`` of stage
0 come last. With tau(u) the per-stage time of unit u's F + B (the slice time less its
weight gradients) and W(b) a batch slice's fused weight gradients over its b x L tokens,
the objective is

    T_zb = sum_u tau(u) + (K - 1) * max_u tau(u) + sum_d W(b_d)

so Eq. 5 holds with t replaced by tau (``t_max`` now bounds F + B), and the fused
``W`` adds a term that depends on the batch split only: the exact joint DP
(:func:`~tplib.planner.joint.exact_joint`) minimises it by adding W(b) to each batch
slice in its knapsack. Token slicing no longer pays for the weight gradients: a slice's
tau lacks them, so the DP cuts finer than it does for ``terapipe``.

T_zb is exact when each slice's F and B share the largest tau; in general the
fill-drain latency of ``terapipe-zb`` on equal stages with free communication is
sum tau + (K - 1) * (max F + max B) + sum W, so T_zb is a lower bound that can break a
tie the wrong way (by 0.6% on the brute-force grids of the tests).

A cost model prices the weight gradients through :class:`WeightGradModel`.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from tplib.plan import Plan
from tplib.planner.joint import exact_joint
from tplib.sim.costs import SliceCostModel

__all__ = ["ForwardBackwardCost", "WeightGradModel", "plan_zero_bubble", "zero_bubble_latency"]


class WeightGradModel(SliceCostModel, Protocol):
    """A slice cost model that also prices the weight gradients."""

    def wgrad_time(self, batch_slice_size: int, length: np.ndarray) -> np.ndarray:
        """Seconds of one stage's weight gradients over ``batch_slice_size`` sequences of
        ``length`` tokens, computed at once (numpy broadcasting over ``length``)."""
        ...


class ForwardBackwardCost:
    """tau(b, l, c): a slice's time less its weight gradients, the DP's cost under
    ``terapipe-zb``."""

    def __init__(self, cost: WeightGradModel) -> None:
        self.cost = cost
        self.max_batch_slice_size = cost.max_batch_slice_size

    def slice_time(
        self, batch_slice_size: int, length: np.ndarray, context: np.ndarray
    ) -> np.ndarray:
        t = self.cost.slice_time(batch_slice_size, length, context)
        return t - self.cost.wgrad_time(batch_slice_size, np.asarray(length))


def _fused(cost: WeightGradModel, batch_slice_size: int, seq_len: int) -> float:
    """W(b): a batch slice's weight gradients over its whole sequences at once."""
    return float(cost.wgrad_time(batch_slice_size, np.array([seq_len]))[0])


def zero_bubble_latency(cost: WeightGradModel, plan: Plan, n_stages: int) -> float:
    """T_zb of ``plan`` (see the module docstring), summed unit by unit from the
    definition: the reference oracle that :func:`plan_zero_bubble`'s plans are tested
    to minimise, and a way to price any plan under ``terapipe-zb``'s objective."""
    fb = ForwardBackwardCost(cost)
    tau = [
        float(
            fb.slice_time(
                plan.batch_slices[u.b],
                np.array([plan.token_slices[u.b][u.t]]),
                np.array([plan.token_offset(u.b, u.t)]),
            )[0]
        )
        for u in plan.units()
    ]
    fused = sum(_fused(cost, b, plan.seq_len) for b in plan.batch_slices)
    return sum(tau) + (n_stages - 1) * max(tau) + fused


def plan_zero_bubble(
    cost: WeightGradModel,
    *,
    seq_len: int,
    batch: int,
    n_stages: int,
    granularity: int = 8,
    eps: float = 0.0,
    max_batch_slice_size: int | None = None,
) -> Plan:
    """The plan minimising T_zb; ``Plan.latency`` is T_zb and ``Plan.t_max`` the largest
    tau."""
    return exact_joint(
        ForwardBackwardCost(cost),
        seq_len=seq_len,
        batch=batch,
        n_stages=n_stages,
        granularity=granularity,
        eps=eps,
        max_batch_slice_size=max_batch_slice_size,
        per_batch_slice=lambda b: _fused(cost, b, seq_len),
    )
